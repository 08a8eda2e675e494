# cmake -DCHECK=<CheckSass.cmake> -DWORK=<scratch folder> -P check_sass_test.cmake
# Self-test of CheckSass.cmake's BETWEEN rule on made-up listings (a stand-in cuobjdump prints
# them; no CUDA needed): a stretch is counted from the last <from> before its <to>, never across
# a function, a stretch with too few matches fails with one message, and a listing without any
# stretch fails. Prints one line per case; fails on the first case that goes wrong.
cmake_minimum_required(VERSION 3.25)
file(MAKE_DIRECTORY "${WORK}")
file(WRITE "${WORK}/fake_cuobjdump" "#!/bin/sh\ncat \"$2\"\n")
file(CHMOD "${WORK}/fake_cuobjdump" PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE)
set(rule "WARPGROUP.DEPBAR.LE gsb0, 0x1|WARPGROUP.DEPBAR.LE gsb0, 0x0|MUFU.EX2|1")
set(fn "\t\tFunction : f\n")
set(wait1 "        /*0010*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;\n")
set(wait0 "        /*0050*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n")
set(ex2 "        /*0020*/                   MUFU.EX2 R1, R2 ;\n")
set(fadd "        /*0030*/                   FADD R1, R2, R3 ;\n")

# expect(<case> <listing> <0: passes, 1: fails> <regex the output must match>
#        [<regex it must not match>])
function(expect name listing fails regex)
  file(WRITE "${WORK}/${name}.sass" "${listing}")
  execute_process(COMMAND ${CMAKE_COMMAND} -DCUOBJDUMP=${WORK}/fake_cuobjdump
                          -DLIB=${WORK}/${name}.sass "-DBETWEEN=${rule}" -P ${CHECK}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REGEX REPLACE "[ \n]+" " " text "${out}${err}")
  set(forbid "${ARGN}")
  if((fails AND rc EQUAL 0) OR (NOT fails AND NOT rc EQUAL 0) OR NOT text MATCHES "${regex}"
     OR (forbid AND text MATCHES "${forbid}"))
    message(FATAL_ERROR "case ${name}: exit ${rc}, expected it to ${fails} fail, to match "
                        "'${regex}' and not '${forbid}'; output:\n${out}${err}")
  endif()
  message(STATUS "case ${name}: ok")
endfunction()

expect(two_functions "${fn}${wait1}${ex2}${wait0}${fn}${wait1}${ex2}${wait0}" 0
       "MUFU.EX2 from '[^']*' to '[^']*': 1 1")
expect(empty_stretch "${fn}${wait1}${fadd}${wait0}" 1 "0 MUFU.EX2 from" "followed by")
expect(last_from_counts "${fn}${wait1}${ex2}${wait1}${fadd}${wait0}" 1 "0 MUFU.EX2 from")
expect(not_across_functions "${fn}${wait1}${ex2}${fn}${wait0}" 1 "no 'WARPGROUP[^']*' followed by")
expect(no_stretch "${fn}${ex2}${wait0}" 1 "no 'WARPGROUP[^']*' followed by")
