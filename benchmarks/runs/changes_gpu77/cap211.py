import sys
import pytest
mode = sys.argv[1]
if mode == "old":
    import rpcompile.capture as C
    C.guard_reads = lambda *a: None
    C.reads_after = lambda *a: None
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", "tests/test_capture.py", "-k", "plain_attribute", "--tb=short"]))
