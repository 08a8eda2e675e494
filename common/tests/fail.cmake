# Fails with FA_FAIL_MESSAGE: a test that stands in for one that cannot run (e.g. host.python
# without pytest), so that a run says what is missing instead of silently testing less.
message(FATAL_ERROR "${FA_FAIL_MESSAGE}")
