"""One way for a test to need GPUs: the `gpu` marker (tests/conftest.py skips it without them).
A test that checks for CUDA itself would run or skip by a rule of its own, which `-m gpu` does
not select."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).parent
# A skip decided by asking torch (or a HAS_CUDA flag) whether CUDA is there.
OWN_RULE = re.compile(
    r"skip(if)?\((not )?(torch\.cuda\.|_?util\.HAS_CUDA|HAS_CUDA)|cuda\.is_available\(\):\s*\n\s*pytest\.skip"
)


def own_rules(text: str) -> list[str]:
    return [m.group(0).splitlines()[0] for m in OWN_RULE.finditer(text)]


def test_no_test_checks_for_cuda_itself():
    found = {
        str(path.relative_to(TESTS)): hits
        for path in TESTS.rglob("*.py")
        if path.name != Path(__file__).name and (hits := own_rules(path.read_text()))
    }
    # test_pdl checks the CPU default, so it skips *with* CUDA: the one exception, by name.
    found.pop("kernels/test_pdl.py", None)
    assert found == {}


def test_the_scan_sees_each_form():
    planted = [
        '@pytest.mark.skipif(not torch.cuda.is_available(), reason="x")',
        'needs = pytest.mark.skipif(not _util.HAS_CUDA, reason="x")',
        'if not torch.cuda.is_available():\n        pytest.skip("x")',
    ]
    assert all(own_rules(text) for text in planted)
    assert not own_rules("@pytest.mark.gpu\ndef test_x(): ...")
