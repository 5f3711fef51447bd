"""Promotion into a Hugging Face repository: upload to a staging branch, then move main in one commit.

1. The campaign is verified locally with the pinned key (tree and summary) before a byte is uploaded, and
   its publication version must be above the one main publishes under the same key (main's
   ``publication.intoto.jsonl``, read at main's resolved sha; a publication signed by another key, or none,
   is not this key's sequence).
2. One commit on the staging branch adds every publishable file and deletes publishable paths the
   campaign no longer has (parent_commit pins the branch head it was computed from).
3. The staging branch is resolved to a commit sha, once. Its publishable tree, as listed by that sha,
   must be exactly the verified campaign (LFS files by sha256, regular files by git blob id): what is
   compared is what will be copied.
4. main is made equal to that commit in ONE commit of server-side copies, every one naming the sha
   (``CommitOperationCopy(src_revision=sha)``), never the branch: a push to staging after step 3 cannot
   leak into main. Publishable paths on main that the campaign lacks are deleted in the same commit, and
   parent_commit pins main's head, so a concurrent change to main fails the promotion instead of mixing.
5. The new main commit is read back and compared again.

Only publishable paths (``fq.promote.is_publishable``) are ever uploaded, compared, copied or deleted;
other files of the repository (README.md, .gitattributes) are left as they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import tempfile
from pathlib import Path

from fq.errors import FqError, SignatureError
from fq.promote import Publication, check_version, is_publishable
from fq.provenance.publication import NAME as PUBLICATION_NAME, read_publication

DEFAULT_STAGING = "fq-staging"


@dataclass
class HubResult:
    repo: str
    staging: str
    staged_sha: str
    main_sha: str
    previous_main: str
    files: int
    deleted: list[str]


def parse_target(text: str) -> str:
    """``hf://owner/name`` -> ``owner/name``."""
    repo = text[len("hf://"):] if text.startswith("hf://") else text
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts):
        raise FqError(f"{text!r}: expected a Hugging Face repository hf://OWNER/NAME")
    return repo


def _git_blob_id(path) -> str:
    from huggingface_hub.utils import sha

    return sha.git_hash(path.read_bytes())


def _publishable_tree(info) -> dict:
    return {s.rfilename: s for s in (info.siblings or []) if is_publishable(s.rfilename)}


def _differences(pub: Publication, tree: dict) -> list[str]:
    """How the repository's publishable files at one commit differ from the verified campaign."""
    want = pub.digests()
    out = [f"{n}: not in the campaign" for n in sorted(set(tree) - set(want))]
    out += [f"{n}: missing" for n in sorted(set(want) - set(tree))]
    for name in sorted(set(want) & set(tree)):
        sha, size = want[name]
        remote = tree[name]
        if remote.lfs is not None:
            same = remote.lfs.sha256 == sha and remote.lfs.size == size
        else:
            same = remote.size == size and remote.blob_id == _git_blob_id(pub.files[name])
        if not same:
            out.append(f"{name}: different bytes")
    return out


def _info(api, repo: str, revision: str):
    from huggingface_hub.utils import HfHubHTTPError

    try:
        return api.model_info(repo, revision=revision, files_metadata=True)
    except HfHubHTTPError as e:
        raise FqError(f"hf://{repo}@{revision}: {str(e).splitlines()[0]}") from None


def _one_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def _main_versions(api, repo: str, main, key) -> list[tuple[str, int]]:
    """(what, version) of the publication statement main holds, when it is one signed by ``key``."""
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    if PUBLICATION_NAME not in {s.rfilename for s in (main.siblings or [])}:
        return []
    r = get_session().get(f"{api.endpoint}/{repo}/resolve/{main.sha}/{PUBLICATION_NAME}",
                          headers=build_hf_headers(token=api.token), follow_redirects=True)
    hf_raise_for_status(r)
    with tempfile.TemporaryDirectory(prefix="fq-promote-") as d:
        (Path(d) / PUBLICATION_NAME).write_bytes(r.content)
        try:
            stmt = read_publication(d, key)
        except SignatureError:
            return []
    return [(f"hf://{repo}@main ({main.sha[:12]})", stmt.version)]


def promote_hub(pub: Publication, repo: str, *, staging: str = DEFAULT_STAGING, endpoint: str | None = None,
                token: str | None = None, api=None, key=None) -> HubResult:
    """Upload ``pub`` (already verified by the caller) to ``staging`` and make main equal to it. With ``key``
    (the pinned public key), main's publication version under that key must be below ``pub``'s."""
    import httpx2  # huggingface_hub's HTTP client: its transport errors (refused, reset, timeout)
    from huggingface_hub import CommitOperationAdd, CommitOperationCopy, CommitOperationDelete, HfApi
    from huggingface_hub.utils import HfHubHTTPError

    if staging == "main":
        raise FqError("--staging main: the staging branch must not be main")
    api = api or HfApi(endpoint=endpoint, token=token)
    where = f"hf://{repo}"
    try:
        main = _info(api, repo, "main")
        if key is not None:
            stmt = read_publication(pub.published, key)
            if _differences(pub, _publishable_tree(main)):  # the same publication again changes nothing
                check_version(stmt, _main_versions(api, repo, main, key), f"promote {pub.campaign} to {where}")
        api.create_branch(repo, branch=staging, revision=main.sha, exist_ok=True)

        # 2. upload: every publishable file, and deletions of publishable paths the campaign lacks
        head = _info(api, repo, staging)
        stale = sorted(set(_publishable_tree(head)) - set(pub.files))
        ops = [CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(p)) for n, p in pub.files.items()]
        ops += [CommitOperationDelete(path_in_repo=n) for n in stale]
        api.create_commit(repo, ops, revision=staging, parent_commit=head.sha,
                          commit_message=f"fq promote: stage {pub.campaign.name} ({pub.digest()[:16]})")

        # 3. resolve the staging branch once; everything below names this sha, never the branch
        staged = _info(api, repo, staging)
        sha = staged.sha
        diff = _differences(pub, _publishable_tree(staged))
        if diff:
            raise FqError(f"{where}@{staging} resolved to {sha}, which is not the verified campaign "
                          f"({len(diff)} difference(s): {'; '.join(diff[:5])}); another push to {staging}? "
                          f"nothing was promoted")

        # 4. main := that commit, in one commit of server-side copies from the sha
        main = _info(api, repo, "main")
        removed = sorted(set(_publishable_tree(main)) - set(pub.files))
        ops = [CommitOperationCopy(src_path_in_repo=n, path_in_repo=n, src_revision=sha) for n in pub.files]
        ops += [CommitOperationDelete(path_in_repo=n) for n in removed]
        commit = api.create_commit(repo, ops, revision="main", parent_commit=main.sha,
                                   commit_message=f"fq promote: main = {staging}@{sha[:12]} ({pub.campaign.name})")
        # 5. read back the commit main now points at (by sha: a later push to main is not ours to judge)
        after = _info(api, repo, commit.oid)
    except (HfHubHTTPError, httpx2.HTTPError) as e:
        raise FqError(f"{where}: {_one_line(e)}") from None
    diff = _differences(pub, _publishable_tree(after))
    if diff:
        raise FqError(f"{where}: main commit {commit.oid} is not the verified campaign after promotion "
                      f"({len(diff)} difference(s): {'; '.join(diff[:5])})")
    return HubResult(repo, staging, sha, commit.oid, main.sha, len(pub.files), removed)
