"""Shipping artifacts through an OCI registry: push, pull, a local store for `serve oci://...`.

reference.py   oci://HOST[:PORT]/REPO[:TAG|@DIGEST], parsed and checked
registry.py    the distribution API over oras-py's client: auth, blobs (streamed, checked, resumed)
oci.py         an artifact, a kernel-cache unit or a signature as an OCI manifest, and back
push.py        mlac push: every file a blob (OCI digests are the manifest's sha256: nothing hashed twice)
pull.py        mlac pull: only the ranks and the unit asked for, in parallel, resumable, atomic
store.py       the content-addressed download folder behind `serve oci://...`
"""
