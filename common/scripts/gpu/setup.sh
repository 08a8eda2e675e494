# The common start of the area scripts in this folder; each sources it first:
#   . "$(dirname "$0")/setup.sh" NAME
# It sets `set -uo pipefail` (a failing stage is reported and the script goes on), moves to
# the repository root and defines
#   root   the repository root
#   build  the build tree: FA_BUILD_DIR (default build-gpu), made absolute
#   bin    $build/bin
#   out    where logs go: $OUT (default $root/gpu-logs), created
#   log    $out/NAME.log, emptied
#   say    prints its arguments and appends them to $log
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
root=$PWD
build=${FA_BUILD_DIR:-build-gpu}
case $build in /*) ;; *) build=$root/$build ;; esac
bin=$build/bin
out=${OUT:-$root/gpu-logs}
mkdir -p "$out" || exit 2
log=$out/${1:?setup.sh: name the log}.log
: > "$log"
say() { echo "$*" | tee -a "$log"; }
