"""Registry references: oci://HOST[:PORT]/REPO[:TAG|@DIGEST], and one-line refusals of anything else."""

from __future__ import annotations

import pytest

from mlac.core.errors import MlacError
from mlac.ship.reference import Reference, is_reference, parse

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    "text, want",
    [
        ("oci://127.0.0.1:5000/mlac/v3:r1", Reference("127.0.0.1:5000", "mlac/v3", "r1")),
        (
            "oci://registry.example.com/deepseek-ai/deepseek-v3",
            Reference("registry.example.com", "deepseek-ai/deepseek-v3"),
        ),
        (f"oci://localhost:5000/a/b/c@{DIGEST}", Reference("localhost:5000", "a/b/c", None, DIGEST)),
        ("oci://[::1]:5000/x:1.0_rc-2", Reference("[::1]:5000", "x", "1.0_rc-2")),
    ],
)
def test_references_parse(text, want):
    ref = parse(text)
    assert ref == want and is_reference(text)
    assert parse(str(ref)) == ref if ref.tag else True
    assert ref.target == (want.digest or want.tag or "latest")


@pytest.mark.parametrize(
    "text, needle",
    [
        ("s3://bucket/model", "unknown scheme 's3://'"),
        ("https://registry/x:1", "unknown scheme 'https://'"),
        ("oci://registry", "no repository"),
        ("oci://bad_host!/x:1", "'bad_host!' is not a registry host"),
        ("oci://registry/Upper/Case:1", "repository 'Upper/Case' is not valid"),
        ("oci://registry/x:bad tag", "tag 'bad tag' is not a valid tag"),
        ("oci://registry/x@sha256:123", "is not sha256:<64 hex digits>"),
        ("oci://registry/x:" + "t" * 129, "is not a valid tag"),
    ],
)
def test_bad_references_are_one_line_errors(text, needle):
    with pytest.raises(MlacError, match=needle) as e:
        parse(text)
    assert "\n" not in str(e.value)


def test_a_folder_is_not_a_reference():
    assert not is_reference("out/") and not is_reference("/models/v3") and not is_reference(None)
