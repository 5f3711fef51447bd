"""A fake Hugging Face Hub on 127.0.0.1: exactly the HTTP endpoints huggingface_hub 2.4.0 calls for
``model_info``, ``create_branch``, ``list_repo_refs`` and ``create_commit`` (additions through the legacy
LFS protocol, deletions, copies), with git-like storage (commits are immutable trees, branches move).

Not the Hub: no auth, no Xet (clients must run with HF_HUB_DISABLE_XET), model repositories only. What it
keeps honest: a ``*.safetensors`` file is LFS (copies of it are server-side, by sha256), everything else
is a regular git blob whose id is the git sha1; a revision is a branch or a full commit sha; a commit
names a branch, and ``parentCommit`` must be that branch's head (else 412); an lfsFile must name an
object this repository holds. ``hooks`` run after a matching request is handled and before its answer
is sent, which is how a test puts a concurrent push between two calls of the client.

    hub = FakeHub().start(); hub.create_repo("o/n"); ...; hub.stop()
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str, size: int) -> bool:
    return path.endswith(".safetensors") or size >= 10 << 20


@dataclass(frozen=True)
class Blob:
    size: int
    content: bytes | None = None  # regular file
    lfs_oid: str | None = None  # sha256 of an LFS object

    @property
    def oid(self) -> str:  # the git blob id (of the pointer, for LFS)
        if self.lfs_oid is None:
            return git_blob_id(self.content)
        return git_blob_id(LFS_POINTER.format(oid=self.lfs_oid, size=self.size).encode())

    def sibling(self, path: str) -> dict:
        d = {"rfilename": path, "size": self.size, "blobId": self.oid}
        if self.lfs_oid:
            d["lfs"] = {"sha256": self.lfs_oid, "size": self.size, "pointerSize": 128}
        return d

    def path_info(self, path: str) -> dict:
        d = {"type": "file", "path": path, "size": self.size, "oid": self.oid}
        if self.lfs_oid:
            d["lfs"] = {"oid": self.lfs_oid, "size": self.size, "pointerSize": 128}
        return d


@dataclass
class Repo:
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)  # sha -> tree (path -> blob)
    branches: dict[str, str] = field(default_factory=dict)
    lfs: dict[str, bytes] = field(default_factory=dict)  # sha256 -> bytes
    log: list[tuple[str, str, str]] = field(default_factory=list)  # (branch, sha, message)

    def resolve(self, rev: str) -> str | None:
        if rev in self.branches:
            return self.branches[rev]
        return rev if rev in self.commits else None

    def commit(self, branch: str, tree: dict[str, Blob], message: str) -> str:
        parent = self.branches.get(branch, "")
        body = json.dumps([parent, message, sorted((p, b.oid) for p, b in tree.items()), len(self.log)])
        sha = hashlib.sha1(body.encode()).hexdigest()
        self.commits[sha] = dict(tree)
        self.branches[branch] = sha
        self.log.append((branch, sha, message))
        return sha

    def content_of(self, blob: Blob) -> bytes:
        return blob.content if blob.lfs_oid is None else self.lfs[blob.lfs_oid]


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class FakeHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) in order
        self.hooks: list[tuple[str, re.Pattern, object, object]] = []  # (method, path regex, when(hub), fn(hub))
        self.lock = threading.RLock()
        self.server = None

    # -- test-side API --------------------------------------------------------------------------------
    def start(self) -> "FakeHub":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _serve(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                status, headers, payload = hub.handle(method, self.path, self.headers, body)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                self._serve("GET")

            def do_HEAD(self):
                self._serve("HEAD")

            def do_POST(self):
                self._serve("POST")

            def do_PUT(self):
                self._serve("PUT")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def create_repo(self, repo_id: str, files: dict[str, bytes] | None = None) -> None:
        r = self.repos[repo_id] = Repo()
        r.commit("main", {}, "initial commit")
        self.push(repo_id, "main", {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
                                    **(files or {})}, message="repo files")

    def push(self, repo_id: str, branch: str, files: dict[str, bytes], deletes=(), message="push") -> str:
        """A commit by some other client: add/replace ``files``, delete ``deletes``."""
        with self.lock:
            r = self.repos[repo_id]
            tree = dict(r.commits[r.branches[branch]])
            for p in deletes:
                tree.pop(p, None)
            for p, data in files.items():
                tree[p] = self._store(r, p, data)
            return r.commit(branch, tree, message)

    def tree(self, repo_id: str, rev: str) -> dict[str, bytes]:
        r = self.repos[repo_id]
        return {p: r.content_of(b) for p, b in r.commits[r.resolve(rev)].items()}

    def head(self, repo_id: str, branch: str) -> str:
        return self.repos[repo_id].branches[branch]

    def after(self, method: str, path_regex: str, fn, when=lambda hub: True) -> None:
        """Run ``fn(hub)`` once, after the first matching request for which ``when(hub)`` holds is handled,
        before it is answered."""
        self.hooks.append((method, re.compile(path_regex), when, fn))

    def seen(self, method: str, path_regex: str) -> bool:
        return any(m == method and re.fullmatch(path_regex, p) for m, p in self.requests[:-1])

    @staticmethod
    def _store(r: Repo, path: str, data: bytes) -> Blob:
        if is_lfs(path, len(data)):
            oid = hashlib.sha256(data).hexdigest()
            r.lfs[oid] = data
            return Blob(len(data), lfs_oid=oid)
        return Blob(len(data), content=data)

    # -- HTTP -----------------------------------------------------------------------------------------
    def handle(self, method: str, raw_path: str, headers, body: bytes):
        url = urlsplit(raw_path)
        path, query = unquote(url.path), parse_qs(url.query)
        with self.lock:
            self.requests.append((method, path))
            try:
                status, out_headers, payload = self._route(method, path, query, headers, body)
            except HttpError as e:
                status, payload = e.status, json.dumps({"error": e.message}).encode()
                out_headers = {"Content-Type": "application/json", "X-Error-Message": e.message}
                if e.code:
                    out_headers["X-Error-Code"] = e.code
            for hook in list(self.hooks):
                if hook[0] == method and hook[1].fullmatch(path) and hook[2](self):
                    self.hooks.remove(hook)
                    hook[3](self)
        return status, out_headers, payload

    def _repo(self, repo_id: str) -> Repo:
        if repo_id not in self.repos:
            raise HttpError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return self.repos[repo_id]

    def _rev(self, r: Repo, rev: str) -> str:
        sha = r.resolve(rev)
        if sha is None:
            raise HttpError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return sha

    def _route(self, method, path, query, headers, body):
        J = {"Content-Type": "application/json"}
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/(.+)", path):
            if method != "GET":
                raise HttpError(405, "method")
            r = self._repo(m[1])
            sha = self._rev(r, m[2])
            blobs = query.get("blobs", ["false"])[0].lower() == "true"
            siblings = [b.sibling(p) if blobs else {"rfilename": p} for p, b in sorted(r.commits[sha].items())]
            return 200, J, json.dumps({"id": m[1], "modelId": m[1], "sha": sha, "private": False,
                                       "siblings": siblings}).encode()
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/refs", path):
            r = self._repo(m[1])
            branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": s} for b, s in sorted(r.branches.items())]
            return 200, J, json.dumps({"branches": branches, "converts": [], "tags": [], "pullRequests": []}).encode()
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/branch/(.+)", path):
            r = self._repo(m[1])
            if method != "POST":
                raise HttpError(405, "method")
            if m[2] in r.branches:
                raise HttpError(409, f"Reference refs/heads/{m[2]} already exists")
            start = json.loads(body or b"{}").get("startingPoint") or "main"
            r.branches[m[2]] = self._rev(r, start)
            return 200, J, b"{}"
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/preupload/(.+)", path):
            r = self._repo(m[1])
            tree = r.commits[self._rev(r, m[2])]
            files = []
            for f in json.loads(body)["files"]:
                lfs = is_lfs(f["path"], f["size"])
                have = tree.get(f["path"])
                oid = None if have is None else (have.lfs_oid if have.lfs_oid else have.oid)
                files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                              "oid": oid})
            return 200, J, json.dumps({"files": files}).encode()
        if m := re.fullmatch(r"/([^/]+/[^/]+)\.git/info/lfs/objects/batch", path):
            r = self._repo(m[1])
            req = json.loads(body)
            objects = []
            for o in req["objects"]:
                entry = {"oid": o["oid"], "size": o["size"]}
                if o["oid"] not in r.lfs:
                    entry["actions"] = {"upload": {"href": f"{self.endpoint}/lfs-upload/{m[1]}/{o['oid']}"}}
                objects.append(entry)
            return 200, {"Content-Type": "application/vnd.git-lfs+json"}, json.dumps(
                {"transfer": "basic", "objects": objects}).encode()
        if m := re.fullmatch(r"/lfs-upload/([^/]+/[^/]+)/([0-9a-f]{64})", path):
            r = self._repo(m[1])
            if hashlib.sha256(body).hexdigest() != m[2]:
                raise HttpError(400, "LFS object does not match its oid")
            r.lfs[m[2]] = body
            return 200, {}, b""
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/paths-info/(.+)", path):
            r = self._repo(m[1])
            tree = r.commits[self._rev(r, m[2])]
            form = parse_qs(body.decode())
            out = [tree[p].path_info(p) for p in form.get("paths", []) if p in tree]
            return 200, J, json.dumps(out).encode()
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            r = self._repo(m[1])
            tree = r.commits[self._rev(r, m[2])]
            if m[3] not in tree:
                raise HttpError(404, f"{m[3]} not found at {m[2]}", "EntryNotFound")
            return 200, {"Content-Type": "application/octet-stream"}, r.content_of(tree[m[3]])
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/commit/(.+)", path):
            return self._commit(self._repo(m[1]), m[1], m[2], body)
        raise HttpError(404, f"fake hub: no endpoint {method} {path}")

    def _commit(self, r: Repo, repo_id: str, branch: str, body: bytes):
        if branch not in r.branches:
            raise HttpError(400, f"Invalid rev id: {branch} (commits go to a branch)", "RevisionNotFound")
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = lines[0]["value"]
        if header.get("parentCommit") and header["parentCommit"] != r.branches[branch]:
            raise HttpError(412, f"A commit has happened since. Please refresh and try again. "
                                 f"(parent {header['parentCommit']} is not the head of {branch})")
        tree = dict(r.commits[r.branches[branch]])
        for item in lines[1:]:
            v = item["value"]
            if item["key"] == "file":
                data = base64.b64decode(v["content"])
                tree[v["path"]] = Blob(len(data), content=data)
            elif item["key"] == "lfsFile":
                if v["oid"] not in r.lfs:
                    raise HttpError(422, f"lfsFile {v['path']}: unknown LFS object {v['oid']}")
                tree[v["path"]] = Blob(len(r.lfs[v["oid"]]), lfs_oid=v["oid"])
            elif item["key"] == "deletedFile":
                if v["path"] not in tree:
                    raise HttpError(404, f"A file with this name doesn't exist: {v['path']}", "EntryNotFound")
                del tree[v["path"]]
            elif item["key"] == "deletedFolder":
                for p in [p for p in tree if p.startswith(v["path"].rstrip("/") + "/")]:
                    del tree[p]
            else:
                raise HttpError(400, f"unknown commit operation {item['key']}")
        sha = r.commit(branch, tree, header["summary"])
        return 200, {"Content-Type": "application/json"}, json.dumps(
            {"commitUrl": f"{self.endpoint}/{repo_id}/commit/{sha}", "commitOid": sha, "pullRequestUrl": None}).encode()
