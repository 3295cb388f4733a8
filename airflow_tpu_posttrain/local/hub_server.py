"""A small local stand-in for the Hugging Face Hub, for tests and local pipeline runs.

It implements the HTTP endpoints that ``huggingface_hub.HfApi`` uses to create a repo and a branch,
upload a folder over plain HTTP (``HF_HUB_DISABLE_XET=1``: preupload, LFS batch + basic transfer,
NDJSON commit) and read it back (model info, tree, refs, commits, resolve). Dataset repos are read-only: their
owners' uploads are seeded, each commit dated as the Hub dates it.
Repos live on disk under the root directory::

    ROOT/<owner>/<name>/repo.json            private flag, creation date, branch -> head commit sha
    ROOT/<owner>/<name>/commits/<sha>.json   parent, title, message, date, files (path -> entry)
    ROOT/<owner>/<name>/objects/<sha256>     file contents, content-addressed (regular and LFS alike)

Writes need ``Authorization: Bearer <token>``, and so do reads of private repos. A gated repo (``gated``
``auto``/``manual``, set through the repo settings as on the real Hub) shows its info and file list to anyone but
serves its files only to a token granted access to it (:meth:`HubServer.grant`; the token that created the repo
has it): without a token 401, with one that has no grant 403, both ``X-Error-Code: GatedRepo``, which
huggingface_hub raises as ``GatedRepoError`` (``/api/models/<repo>/auth-check`` answers the same, as
``HfApi.auth_check`` asks it). LFS uploads go to a signed URL without
a token, like the pre-signed storage URLs of the real Hub. Every request is kept
in ``HubServer.requests`` with the token value redacted, so a test can check where a token went.
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import signal
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from airflow_tpu_posttrain.local import vpc

log = logging.getLogger(__name__)

# Files matching these patterns (or larger than LFS_MIN_SIZE) are stored as LFS objects, as with the
# .gitattributes the real Hub puts into every new repo.
LFS_PATTERNS = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.h5",
    "*.msgpack",
    "*.onnx",
    "*.gguf",
    "*.model",
    "*.npy",
    "*.npz",
    "*.tar",
    "*.gz",
    "*.zip",
)
LFS_MIN_SIZE = 10 * 1024 * 1024
GITATTRIBUTES = "".join(f"{pattern} filter=lfs diff=lfs merge=lfs -text\n" for pattern in LFS_PATTERNS)
RECORDED_BODY_LIMIT = 1024 * 1024
REDACTED = "<redacted>"

_REPO = r"(?P<repo>[^/]+/[^/]+)"
_REV = r"(?P<rev>[^/]+)"
_ROUTES = [
    ("GET", r"/api/whoami-v2", "whoami"),
    ("POST", r"/api/repos/create", "create_repo"),
    ("POST", r"/api/validate-yaml", "validate_yaml"),
    ("GET", rf"/api/models/{_REPO}", "model_info"),
    ("GET", rf"/api/models/{_REPO}/revision/{_REV}", "model_info"),
    ("GET", rf"/api/datasets/{_REPO}", "dataset_info"),
    ("GET", rf"/api/datasets/{_REPO}/revision/{_REV}", "dataset_info"),
    ("GET", rf"/api/models/{_REPO}/refs", "list_refs"),
    ("GET", rf"/api/models/{_REPO}/auth-check", "auth_check"),
    ("GET", rf"/api/datasets/{_REPO}/auth-check", "dataset_auth_check"),
    ("POST", rf"/api/models/{_REPO}/branch/{_REV}", "create_branch"),
    ("PUT", rf"/api/models/{_REPO}/settings", "update_settings"),
    ("GET", rf"/api/models/{_REPO}/tree/{_REV}(?:/(?P<path>.+))?", "list_tree"),
    ("GET", rf"/api/models/{_REPO}/commits/{_REV}", "list_commits"),
    ("GET", rf"/api/datasets/{_REPO}/commits/{_REV}", "dataset_list_commits"),
    ("GET", rf"/api/datasets/{_REPO}/tree/{_REV}(?:/(?P<path>.+))?", "dataset_list_tree"),
    ("POST", rf"/api/models/{_REPO}/preupload/{_REV}", "preupload"),
    ("POST", rf"/api/models/{_REPO}/commit/{_REV}", "commit"),
    ("POST", rf"/{_REPO}\.git/info/lfs/objects/batch", "lfs_batch"),
    ("POST", rf"/{_REPO}\.git/info/lfs/objects/verify", "lfs_verify"),
    ("PUT", rf"/lfs-upload/{_REPO}/(?P<oid>[0-9a-f]{{64}})", "lfs_upload"),
    ("GET", rf"/datasets/{_REPO}/resolve/{_REV}/(?P<path>.+)", "dataset_resolve"),
    ("HEAD", rf"/datasets/{_REPO}/resolve/{_REV}/(?P<path>.+)", "dataset_resolve"),
    ("GET", rf"/{_REPO}/resolve/{_REV}/(?P<path>.+)", "resolve"),
    ("HEAD", rf"/{_REPO}/resolve/{_REV}/(?P<path>.+)", "resolve"),
]
_COMPILED_ROUTES = [(method, re.compile(pattern), name) for method, pattern, name in _ROUTES]
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
_COMMIT_SHA_RE = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server saw it: header names lower-cased, the authorization value redacted."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    body_size: int


class HubError(Exception):
    """An error answered to the client, with the X-Error-Code header huggingface_hub maps to exceptions."""

    def __init__(self, status: int, message: str, code: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.extra = extra or {}


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _git_blob_sha(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _is_lfs_path(path: str, size: int) -> bool:
    name = path.rsplit("/", 1)[-1]
    return size >= LFS_MIN_SIZE or any(fnmatch.fnmatch(name, pattern) for pattern in LFS_PATTERNS)


def _check_path_in_repo(path: str) -> str:
    if not path or path.startswith("/") or any(part in ("", ".", "..") for part in path.split("/")):
        raise HubError(400, f"Invalid path in repo: {path!r}")
    return path


def _write_json_atomically(path: Path, data: object) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


class RepoStore:
    """Repos, branches, commits and file contents on disk. Mutations are serialised by one lock."""

    def __init__(self, root: Path):
        self.root = root
        self.lock = threading.Lock()

    def repo_dir(self, repo_id: str) -> Path:
        owner, _, name = repo_id.partition("/")
        if not (_NAME_RE.fullmatch(owner) and _NAME_RE.fullmatch(name)) or ".." in repo_id:
            raise HubError(400, f"Invalid repo id: {repo_id!r}")
        return self.root / owner / name

    def load_repo(self, repo_id: str) -> dict | None:
        path = self.repo_dir(repo_id) / "repo.json"
        return json.loads(path.read_text()) if path.exists() else None

    def save_repo(self, repo_id: str, repo: dict) -> None:
        _write_json_atomically(self.repo_dir(repo_id) / "repo.json", repo)

    def create_repo(self, repo_id: str, private: bool, date: str | None = None) -> bool:
        """Create the repo with an initial commit holding .gitattributes; False if it already exists.

        ``date``: when (ISO 8601, UTC), for repos seeded as their owners made them earlier; default now."""
        with self.lock:
            if self.load_repo(repo_id) is not None:
                return False
            repo_dir = self.repo_dir(repo_id)
            (repo_dir / "commits").mkdir(parents=True)
            (repo_dir / "objects").mkdir()
            entry = self.store_content(repo_id, GITATTRIBUTES.encode(), lfs=False)
            sha = self.write_commit(repo_id, None, "initial commit", "", {".gitattributes": entry}, date)
            self.save_repo(
                repo_id, {"id": repo_id, "private": private, "createdAt": date or _now(), "branches": {"main": sha}}
            )
            return True

    def object_path(self, repo_id: str, sha256: str) -> Path:
        return self.repo_dir(repo_id) / "objects" / sha256

    def store_content(self, repo_id: str, content: bytes, lfs: bool) -> dict:
        sha256 = hashlib.sha256(content).hexdigest()
        target = self.object_path(repo_id, sha256)
        if not target.exists():
            tmp = target.with_name(f".{sha256}.{secrets.token_hex(4)}.tmp")
            tmp.write_bytes(content)
            os.replace(tmp, target)
        return self.file_entry(sha256, len(content), lfs, content)

    @staticmethod
    def file_entry(sha256: str, size: int, lfs: bool, content: bytes | None = None) -> dict:
        """A tree entry; ``oid`` is the git blob sha of the content, or of the LFS pointer file."""
        oid = _git_blob_sha(_lfs_pointer(sha256, size) if lfs else content)
        return {"sha256": sha256, "size": size, "lfs": lfs, "oid": oid}

    def write_commit(
        self,
        repo_id: str,
        parent: str | None,
        title: str,
        description: str,
        files: dict[str, dict],
        date: str | None = None,
    ) -> str:
        commit = {
            "parent": parent,
            "title": title,
            "description": description,
            "date": date or _now(),
            "files": files,
        }
        sha = hashlib.sha1(json.dumps(commit, sort_keys=True).encode()).hexdigest()
        _write_json_atomically(self.repo_dir(repo_id) / "commits" / f"{sha}.json", {"id": sha, **commit})
        return sha

    def load_commit(self, repo_id: str, sha: str) -> dict:
        return json.loads((self.repo_dir(repo_id) / "commits" / f"{sha}.json").read_text())

    def seed_repo(
        self, repo_id: str, folder: Path, *, gated: str | bool = False, date: datetime | None = None
    ) -> str:
        """A public repo holding ``folder``'s files on ``main``, as its owner would have uploaded it.

        Returns the commit sha. ``date``: when the owner uploaded them (default now); a repo made for it is as
        old. Server-side: the client's upload protocol is exercised by the runs that publish."""
        when = date.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z") if date else None
        self.create_repo(repo_id, private=False, date=when)
        with self.lock:
            repo = self.load_repo(repo_id)
            head = repo["branches"]["main"]
            files = dict(self.load_commit(repo_id, head)["files"])
            for path in sorted(p for p in folder.rglob("*") if p.is_file()):
                name = path.relative_to(folder).as_posix()
                content = path.read_bytes()
                files[name] = self.store_content(repo_id, content, _is_lfs_path(name, len(content)))
            sha = self.write_commit(repo_id, head, f"Upload {folder.name}", "", files, when)
            repo["branches"]["main"] = sha
            repo["gated"] = gated
            self.save_repo(repo_id, repo)
        return sha

    def resolve_revision(self, repo_id: str, repo: dict, revision: str) -> str:
        """Branch name or commit sha -> commit sha."""
        if revision in repo["branches"]:
            return repo["branches"][revision]
        if (
            _COMMIT_SHA_RE.fullmatch(revision)
            and (self.repo_dir(repo_id) / "commits" / f"{revision}.json").exists()
        ):
            return revision
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")


def _repo_info(repo: str, repo_data: dict, commit: dict, siblings: list[dict], kind: str) -> dict:
    """What the Hub's ``/api/<kind>/<repo>`` answers of every repo: its head commit, dates and visibility."""
    return {
        "_id": hashlib.sha1((repo if kind == "models" else f"{kind}/{repo}").encode()).hexdigest()[:24],
        "id": repo,
        "author": repo.split("/")[0],
        "sha": commit["id"],
        "lastModified": commit["date"],
        "createdAt": repo_data["createdAt"],
        "private": repo_data["private"],
        "gated": repo_data.get("gated", False),
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "tags": [],
        "siblings": siblings,
    }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in separate writes
    server: _HubHTTPServer

    # ---- plumbing -------------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._dispatch()

    do_HEAD = do_POST = do_PUT = do_DELETE = do_GET

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        self.query = parse_qs(url.query)
        self._recorded_body = bytearray()
        self._body_size = 0
        self._responded = False
        try:
            for method, pattern, name in _COMPILED_ROUTES:
                match = pattern.fullmatch(url.path)
                if method == self.command and match:
                    params = {key: unquote(value) for key, value in match.groupdict().items() if value}
                    getattr(self, f"_{name}")(**params)
                    break
            else:
                raise HubError(404, f"No route for {self.command} {url.path}")
        except HubError as error:
            self._fail(error)
        except Exception as error:  # report, keep serving
            log.exception("hub server: %s %s failed", self.command, self.path)
            self._fail(HubError(500, f"Internal error: {error}"))

    def _fail(self, error: HubError) -> None:
        self.close_connection = True
        if self._responded:  # failed while streaming a download: all we can do is hang up
            return
        # The request body may be unread, so this connection cannot carry another request.
        headers = {"X-Error-Message": error.message, "Connection": "close"}
        if error.code:
            headers["X-Error-Code"] = error.code
        self._send_json({"error": error.message, **error.extra}, status=error.status, headers=headers)

    def _record(self) -> None:
        """Called just before the response goes out, so a client that got its answer finds the record."""
        headers = {
            key.lower(): (REDACTED if key.lower() == "authorization" else value)
            for key, value in self.headers.items()
        }
        self.server.hub.requests.append(
            RecordedRequest(self.command, self.path, headers, bytes(self._recorded_body), self._body_size)
        )

    def _iter_body(self) -> Iterator[bytes]:
        """The request body in chunks (Content-Length or chunked encoding), also kept for the record."""
        for chunk in self._raw_body_chunks():
            self._body_size += len(chunk)
            room = RECORDED_BODY_LIMIT - len(self._recorded_body)
            if room > 0:
                self._recorded_body += chunk[:room]
            yield chunk

    def _raw_body_chunks(self) -> Iterator[bytes]:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while size := int(self.rfile.readline().split(b";")[0].strip(), 16):
                yield self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline().strip():  # trailers
                pass
            return
        remaining = int(self.headers.get("Content-Length") or 0)
        while remaining > 0:
            chunk = self.rfile.read(min(remaining, 1 << 20))
            if not chunk:
                raise HubError(400, "Truncated request body")
            remaining -= len(chunk)
            yield chunk

    def _read_body(self) -> bytes:
        return b"".join(self._iter_body())

    def _read_json(self) -> dict:
        try:
            data = json.loads(self._read_body() or b"{}")
        except ValueError as error:
            raise HubError(400, f"Invalid JSON body: {error}") from None
        if not isinstance(data, dict):
            raise HubError(400, "JSON body must be an object")
        return data

    def _send(
        self,
        body: bytes,
        *,
        status: int = 200,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
        content_length: int | None = None,
    ) -> None:
        self._record()
        self._responded = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if content_length is None else content_length))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(
        self,
        data: object,
        *,
        status: int = 200,
        headers: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> None:
        self._send(json.dumps(data).encode(), status=status, content_type=content_type, headers=headers)

    # ---- auth and lookups -----------------------------------------------------------------------

    @property
    def store(self) -> RepoStore:
        return self.server.hub.store

    def _token(self) -> str | None:
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None

    def _require_token(self, *, write: bool = False) -> None:
        token = self._token()
        if token is None:
            raise HubError(401, "Authorization header with a Bearer token is required")
        if not self.server.hub.accepts(token):
            raise HubError(401, "Invalid credentials in Authorization header")
        if write and not self.server.hub.can_write(token):
            # The real Hub answers a write with a read-only token 403 (huggingface/huggingface_hub#1653).
            raise HubError(403, "Forbidden: you must use a write token to upload to a repository.")

    def _repo(self, repo_id: str, *, write: bool = False, store: RepoStore | None = None) -> dict:
        if write:
            self._require_token(write=True)
        repo = (store or self.store).load_repo(repo_id)
        token = self._token()
        hub = self.server.hub
        owns = bool(token) and hub.accepts(token) and hub.owns(token, repo_id)
        can_read = repo is not None and (not repo["private"] or owns or hub.granted(token or "", repo_id))
        if not can_read:  # a private repo is hidden from all but its namespace's members, as on the real Hub
            raise HubError(404, f"Repository Not Found for {repo_id}", "RepoNotFound")
        if write and not owns:
            raise HubError(403, f"You don't have the rights to write to {repo_id}")
        return repo

    def _whoami(self) -> None:
        """``HfApi.whoami``: the token's user, its organizations and the token's role."""
        self._require_token()
        token = self._token()
        user, *orgs = self.server.hub.namespaces_of(token)
        role = "write" if self.server.hub.can_write(token) else "read"
        self._send_json({
            "type": "user", "name": user, "orgs": [{"name": org, "type": "org"} for org in orgs],
            "auth": {"type": "access_token", "accessToken": {"displayName": "token", "role": role}},
        })

    def _check_gate(self, repo_id: str, repo: dict) -> None:
        """The real Hub's answers to a download from a gated repo (huggingface_hub's ``hf_raise_for_status``)."""
        if not repo.get("gated"):
            return
        token = self._token()
        if token is None:
            raise HubError(
                401,
                f"Access to model {repo_id} is restricted. You must have access to it and be authenticated to "
                "access it. Please log in.",
                "GatedRepo",
            )
        if not self.server.hub.accepts(token):
            raise HubError(401, "Invalid credentials in Authorization header")
        if not self.server.hub.granted(token, repo_id):
            raise HubError(
                403,
                f"Access to model {repo_id} is restricted and you are not in the authorized list. Visit "
                f"{self.server.hub.url}/{repo_id} to ask for access.",
                "GatedRepo",
            )

    def _auth_check(self, repo: str) -> None:
        """``HfApi.auth_check``: whether this caller may download the repo's files."""
        self._check_gate(repo, self._repo(repo))
        self._send_json({})

    def _dataset_auth_check(self, repo: str) -> None:
        self._check_gate(repo, self._repo(repo, store=self.server.hub.datasets))
        self._send_json({})

    def _head_commit(self, repo_id: str, rev: str, store: RepoStore | None = None) -> dict:
        store = store or self.store
        repo = self._repo(repo_id, store=store)
        return store.load_commit(repo_id, store.resolve_revision(repo_id, repo, rev))

    def _flag(self, name: str) -> bool:
        return self.query.get(name, [""])[0].lower() in ("1", "true")

    # ---- repos, refs, info ----------------------------------------------------------------------

    def _create_repo(self) -> None:
        self._require_token(write=True)
        payload = self._read_json()
        if payload.get("type", "model") != "model":
            raise HubError(400, "Only model repos are supported by this server")
        if not payload.get("organization"):
            raise HubError(400, "This server has no users: give the repo id as owner/name")
        repo_id = f"{payload['organization']}/{payload.get('name')}"
        if not self.server.hub.owns(self._token(), repo_id):
            raise HubError(
                403, f'You don\'t have the rights to create a model under the namespace "{payload["organization"]}"'
            )
        private = payload.get("visibility", "private" if payload.get("private") else "public") == "private"
        url = f"{self.server.hub.url}/{repo_id}"
        if not self.store.create_repo(repo_id, private):
            raise HubError(409, "You already created this model repo", extra={"url": url})
        self.server.hub.grant(self._token(), repo_id)  # its creator reads it, gated or not
        self._send_json({"url": url, "name": repo_id, "id": repo_id})

    def _validate_yaml(self) -> None:
        """What huggingface_hub asks before committing a README.md.

        Its metadata must be a YAML mapping, and a ``base_model`` must name models of this Hub (the real Hub
        refuses, e.g., a local path there: huggingface/autotrain-advanced#651); ``datasets`` and ``tags`` are
        lists of strings."""
        import yaml

        content = self._read_json().get("content", "")
        errors: list[str] = []
        front = re.match(r"---\n(.*?)\n---\n", content, re.S)
        metadata = {}
        if front:
            try:
                metadata = yaml.safe_load(front[1]) or {}
            except yaml.YAMLError as error:
                errors.append(f"Invalid YAML: {error}")
            if not isinstance(metadata, dict):
                errors.append("The metadata must be a YAML mapping")
                metadata = {}
        base_models = metadata.get("base_model") or []
        for base in [base_models] if isinstance(base_models, str) else base_models:
            if not (isinstance(base, str) and self._model_exists(base)):
                errors.append(
                    f'"base_model" with value "{base}" is not valid. Use a model id from {self.server.hub.url}'
                )
        for key in ("datasets", "tags"):
            value = metadata.get(key)
            if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                errors.append(f'"{key}" must be a list of strings')
        if errors:
            self._send_json({"errors": [{"message": m} for m in errors], "warnings": []}, status=400)
            return
        self._send_json({"errors": [], "warnings": []})

    def _dataset_info(self, repo: str, rev: str = "main") -> None:
        """What ``HfApi.dataset_info`` reads: the head commit of a dataset repo (its owner uploads it)."""
        datasets = self.server.hub.datasets
        repo_data = self._repo(repo, store=datasets)
        commit = datasets.load_commit(repo, datasets.resolve_revision(repo, repo_data, rev))
        siblings = [{"rfilename": path} for path in sorted(commit["files"])]
        self._send_json(_repo_info(repo, repo_data, commit, siblings, "datasets"))

    def _model_exists(self, repo_id: str) -> bool:
        try:
            return self.store.load_repo(repo_id) is not None
        except HubError:  # not a repo id at all
            return False

    def _create_branch(self, repo: str, rev: str) -> None:
        self._repo(repo, write=True)
        starting_point = self._read_json().get("startingPoint") or "main"
        with self.store.lock:
            repo_data = self.store.load_repo(repo)
            if rev in repo_data["branches"]:
                raise HubError(409, f"Reference refs/heads/{rev} already exists")
            sha = self.store.resolve_revision(repo, repo_data, starting_point)
            repo_data["branches"][rev] = sha
            self.store.save_repo(repo, repo_data)
        self._send_json({})

    def _update_settings(self, repo: str) -> None:
        self._repo(repo, write=True)
        settings = self._read_json()
        gated = settings.get("gated")
        if gated not in (None, "auto", "manual", False):
            raise HubError(400, f"Invalid gated value {gated!r}: use 'auto', 'manual' or false")
        with self.store.lock:
            repo_data = self.store.load_repo(repo)
            if gated is not None:
                repo_data["gated"] = gated
            if "visibility" in settings:
                repo_data["private"] = settings["visibility"] == "private"
            self.store.save_repo(repo, repo_data)
        self._send_json({})

    def _list_refs(self, repo: str) -> None:
        repo_data = self._repo(repo)
        branches = [
            {"name": name, "ref": f"refs/heads/{name}", "targetCommit": sha}
            for name, sha in sorted(repo_data["branches"].items())
        ]
        self._send_json({"branches": branches, "converts": [], "tags": [], "pullRequests": []})

    def _model_info(self, repo: str, rev: str = "main") -> None:
        repo_data = self._repo(repo)
        commit = self._head_commit(repo, rev)
        with_blobs = self._flag("blobs")
        siblings = []
        for path, entry in sorted(commit["files"].items()):
            sibling = {"rfilename": path}
            if with_blobs:
                sibling.update(size=entry["size"], blobId=entry["oid"])
                if entry["lfs"]:
                    sibling["lfs"] = {
                        "size": entry["size"],
                        "sha256": entry["sha256"],
                        "pointerSize": len(_lfs_pointer(entry["sha256"], entry["size"])),
                    }
            siblings.append(sibling)
        self._send_json(
            {
                **_repo_info(repo, repo_data, commit, siblings, "models"),
                "modelId": repo,
                "usedStorage": sum(entry["size"] for entry in commit["files"].values()),
            }
        )

    def _dataset_list_tree(self, repo: str, rev: str, path: str = "") -> None:
        self._list_tree(repo, rev, path, self.server.hub.datasets)

    def _list_tree(self, repo: str, rev: str, path: str = "", store: RepoStore | None = None) -> None:
        files = self._head_commit(repo, rev, store)["files"]
        prefix = f"{path.strip('/')}/" if path.strip("/") else ""
        if prefix and not any(name.startswith(prefix) for name in files):
            raise HubError(404, f"{path} does not exist on {rev}", "EntryNotFound")
        recursive = self._flag("recursive")
        listing: dict[str, dict] = {}
        for name, entry in sorted(files.items()):
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix) :].split("/")
            for depth in range(1, len(parts) if recursive else min(len(parts), 2)):
                folder = prefix + "/".join(parts[:depth])
                folder_oid = hashlib.sha1(f"{rev}:{folder}".encode()).hexdigest()
                listing.setdefault(
                    folder, {"type": "directory", "oid": folder_oid, "size": 0, "path": folder}
                )
            if recursive or len(parts) == 1:
                listing[name] = self._tree_file(name, entry)
        self._send_json(list(listing.values()))

    @staticmethod
    def _tree_file(path: str, entry: dict) -> dict:
        item = {"type": "file", "oid": entry["oid"], "size": entry["size"], "path": path}
        if entry["lfs"]:
            pointer_size = len(_lfs_pointer(entry["sha256"], entry["size"]))
            item["lfs"] = {"oid": entry["sha256"], "size": entry["size"], "pointerSize": pointer_size}
        return item

    def _dataset_list_commits(self, repo: str, rev: str) -> None:
        self._list_commits(repo, rev, self.server.hub.datasets)

    def _list_commits(self, repo: str, rev: str, store: RepoStore | None = None) -> None:
        """``HfApi.list_repo_commits``: the history of ``rev``, newest first, each with its date."""
        store = store or self.store
        repo_data = self._repo(repo, store=store)
        commit: dict | None = store.load_commit(repo, store.resolve_revision(repo, repo_data, rev))
        history = []
        while commit is not None:
            message = commit["title"] + (f"\n\n{commit['description']}" if commit["description"] else "")
            history.append(
                {
                    "id": commit["id"],
                    "title": commit["title"],
                    "message": message,
                    "date": commit["date"],
                    "authors": [],
                }
            )
            commit = store.load_commit(repo, commit["parent"]) if commit["parent"] else None
        self._send_json(history)

    # ---- uploads --------------------------------------------------------------------------------

    def _writable_branch(self, repo: str, rev: str) -> str:
        """The head sha of branch ``rev``; only branches take commits, and pull requests are unsupported."""
        repo_data = self._repo(repo, write=True)
        if self._flag("create_pr"):
            raise HubError(400, "Pull requests are not supported by this server")
        if rev not in repo_data["branches"]:
            raise HubError(404, f"Branch {rev} does not exist", "RevisionNotFound")
        return repo_data["branches"][rev]

    def _preupload(self, repo: str, rev: str) -> None:
        head = self._writable_branch(repo, rev)
        existing = self.store.load_commit(repo, head)["files"]
        answers = []
        for item in self._read_json().get("files", []):
            path = _check_path_in_repo(item["path"])
            lfs = _is_lfs_path(path, int(item["size"]))
            answer = {"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False}
            if (entry := existing.get(path)) is not None:
                # The client compares this with its local oid to drop unchanged files from the commit.
                answer["oid"] = entry["sha256"] if lfs else entry["oid"]
            answers.append(answer)
        self._send_json({"files": answers, "commitOid": head})

    def _lfs_batch(self, repo: str) -> None:
        self._repo(repo, write=True)
        request = self._read_json()
        if request.get("operation") != "upload":
            raise HubError(400, "Only the LFS upload operation is supported")
        objects = []
        for obj in request.get("objects", []):
            oid, size = str(obj.get("oid")), int(obj.get("size", -1))
            if not re.fullmatch(r"[0-9a-f]{64}", oid) or size < 0:
                error = {"code": 422, "message": "Invalid object"}
                objects.append({"oid": oid, "size": size, "error": error})
            elif self.store.object_path(repo, oid).exists():
                objects.append({"oid": oid, "size": size})  # no actions: already uploaded
            else:
                upload_url = (
                    f"{self.server.hub.url}/lfs-upload/{repo}/{oid}"
                    f"?size={size}&signature={self.server.hub.sign(repo, oid, size)}"
                )
                verify_url = f"{self.server.hub.url}/{repo}.git/info/lfs/objects/verify"
                objects.append(
                    {
                        "oid": oid,
                        "size": size,
                        "authenticated": True,
                        "actions": {"upload": {"href": upload_url}, "verify": {"href": verify_url}},
                    }
                )
        self._send_json(
            {"transfer": "basic", "objects": objects}, content_type="application/vnd.git-lfs+json"
        )

    def _lfs_upload(self, repo: str, oid: str) -> None:
        size = int(self.query.get("size", ["-1"])[0])
        signature = self.query.get("signature", [""])[0]
        if not hmac.compare_digest(signature, self.server.hub.sign(repo, oid, size)):
            raise HubError(403, "Invalid upload signature")
        target = self.store.object_path(repo, oid)
        digest, received = hashlib.sha256(), 0
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".upload-", delete=False) as tmp:
            try:
                for chunk in self._iter_body():
                    digest.update(chunk)
                    received += len(chunk)
                    tmp.write(chunk)
                tmp.close()
                if digest.hexdigest() != oid or received != size:
                    raise HubError(400, f"Uploaded content does not match oid {oid} and size {size}")
                os.replace(tmp.name, target)
            finally:
                Path(tmp.name).unlink(missing_ok=True)
        self._send(b"")

    def _lfs_verify(self, repo: str) -> None:
        self._repo(repo, write=True)
        obj = self._read_json()
        path = self.store.object_path(repo, str(obj.get("oid")))
        if not path.exists() or path.stat().st_size != obj.get("size"):
            raise HubError(404, f"LFS object {obj.get('oid')} was not uploaded")
        self._send_json({"success": True})

    def _commit(self, repo: str, rev: str) -> None:
        self._writable_branch(repo, rev)
        try:
            lines = [json.loads(line) for line in self._read_body().splitlines() if line.strip()]
        except ValueError as error:
            raise HubError(400, f"Invalid NDJSON commit payload: {error}") from None
        if not lines or lines[0].get("key") != "header" or not lines[0]["value"].get("summary"):
            raise HubError(400, "A commit starts with a header line holding a summary")
        header = lines[0]["value"]
        changes = {}
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value", {})
            path = _check_path_in_repo(value.get("path", ""))
            if key == "file":
                content = base64.b64decode(value["content"])
                changes[path] = self.store.store_content(repo, content, lfs=False)
            elif key == "lfsFile":
                sha256, size = value["oid"], int(value["size"])
                if not (self.store.object_path(repo, sha256).exists() and value.get("algo") == "sha256"):
                    raise HubError(422, f"LFS object {sha256} for {path} was not uploaded")
                changes[path] = self.store.file_entry(sha256, size, lfs=True)
            else:
                raise HubError(400, f"Unsupported commit operation {key!r}")
        with self.store.lock:
            repo_data = self.store.load_repo(repo)
            head = repo_data["branches"][rev]
            if header.get("parentCommit") not in (None, head):
                raise HubError(412, f"Parent commit {header['parentCommit']} is not the head of {rev}")
            files = {**self.store.load_commit(repo, head)["files"], **changes}
            sha = self.store.write_commit(repo, head, header["summary"], header.get("description", ""), files)
            repo_data["branches"][rev] = sha
            self.store.save_repo(repo, repo_data)
        self._send_json(
            {
                "success": True,
                "commitOid": sha,
                "commitUrl": f"{self.server.hub.url}/{repo}/commit/{sha}",
                "hookOutput": "",
            }
        )

    # ---- downloads ------------------------------------------------------------------------------

    def _dataset_resolve(self, repo: str, rev: str, path: str) -> None:
        self._resolve(repo, rev, path, self.server.hub.datasets)

    def _resolve(self, repo: str, rev: str, path: str, store: RepoStore | None = None) -> None:
        store = store or self.store
        self._check_gate(repo, self._repo(repo, store=store))
        commit = self._head_commit(repo, rev, store)
        entry = commit["files"].get(path)
        if entry is None:
            raise HubError(404, f"{path} does not exist on {rev}", "EntryNotFound")
        etag = entry["sha256"] if entry["lfs"] else entry["oid"]
        headers = {"X-Repo-Commit": commit["id"], "ETag": f'"{etag}"'}
        self._send(
            b"", content_type="application/octet-stream", headers=headers, content_length=entry["size"]
        )
        if self.command == "GET":
            with store.object_path(repo, entry["sha256"]).open("rb") as content:
                while chunk := content.read(1 << 20):
                    self.wfile.write(chunk)


class _HubHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    hub: HubServer


class HubServer:
    """A local Hub on the local VPC's internet address, serving repos stored under ``root_dir``.

    ``tokens``: if given, only these Bearer tokens are accepted; otherwise any non-empty one is.
    ``read_only_tokens``: also accepted, for reading only (a write answers 403, as the real Hub does).
    ``namespaces``: token -> its user's name and organizations, where it may create and write repos and read
    private ones (elsewhere 403, and a private repo is not found: 404). A token not named here is a user
    ``local`` who may write everywhere (the unit tests of the server's protocol).
    """

    def __init__(
        self,
        root_dir: str | os.PathLike,
        port: int = 0,
        *,
        tokens: Iterable[str] | None = None,
        read_only_tokens: Iterable[str] = (),
        namespaces: Mapping[str, Sequence[str]] | None = None,
    ):
        self.root_dir = Path(root_dir)
        self.root_dir.mkdir(parents=True, exist_ok=True)
        self.store = RepoStore(self.root_dir)
        # Dataset repos: a namespace of their own, as on the Hub ("_" starts no owner name). Read-only here: their
        # owners' uploads are seeded (RepoStore.seed_repo).
        self.datasets = RepoStore(self.root_dir / "_datasets")
        self.requests: list[RecordedRequest] = []
        self._tokens = frozenset(tokens) if tokens is not None else None
        self._read_only_tokens = set(read_only_tokens)
        self._grants: dict[str, set[str]] = {}  # token -> the gated repos it was granted
        self._namespaces = {token: tuple(names) for token, names in (namespaces or {}).items()}
        self._signing_key = secrets.token_bytes(32)
        # On the local VPC's internet (local/vpc.py): a VM reaches it only through an external IP or a Cloud NAT.
        vpc.ensure_network()
        self._httpd = _HubHTTPServer((vpc.INTERNET_ADDRESS, port), _Handler)
        self._httpd.hub = self
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{vpc.INTERNET_ADDRESS}:{self.port}"

    def accepts(self, token: str) -> bool:
        return self._tokens is None or token in self._tokens or token in self._read_only_tokens

    def can_write(self, token: str) -> bool:
        return token not in self._read_only_tokens

    def set_read_only(self, token: str, read_only: bool = True) -> None:
        """A token's write role taken away (or given back), as a user does on the Hub's token page."""
        (self._read_only_tokens.add if read_only else self._read_only_tokens.discard)(token)

    def namespaces_of(self, token: str) -> tuple[str, ...]:
        """The token's user name, then its organizations."""
        return self._namespaces.get(token, ("local",))

    def owns(self, token: str | None, repo_id: str) -> bool:
        """Whether the token's user may create and write ``repo_id`` (its namespace is theirs or an org's)."""
        if not token:
            return False
        return token not in self._namespaces or repo_id.split("/", 1)[0] in self._namespaces[token]

    def grant(self, token: str, repo_id: str) -> None:
        """Access to a gated repo's files, as the repo's authors grant a user's request on the real Hub."""
        self._grants.setdefault(token, set()).add(repo_id)

    def revoke(self, token: str, repo_id: str) -> None:
        self._grants.get(token, set()).discard(repo_id)

    def granted(self, token: str, repo_id: str) -> bool:
        return repo_id in self._grants.get(token, ())

    def sign(self, repo_id: str, oid: str, size: int) -> str:
        """Signature of a one-object LFS upload URL (stands in for a pre-signed storage URL)."""
        return hmac.new(self._signing_key, f"{repo_id}:{oid}:{size}".encode(), hashlib.sha256).hexdigest()

    def start(self) -> HubServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=0, help="port on 10.203.0.1 (0: any free port)")
    parser.add_argument("--root", required=True, help="directory holding the repos")
    parser.add_argument("--token-file", help="accept only the token in this file (default: any token)")
    args = parser.parse_args(argv)
    tokens = [Path(args.token_file).read_text().strip()] if args.token_file else None
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    with HubServer(args.root, args.port, tokens=tokens) as server:
        print(f"hub server listening on {server.url}", flush=True)
        try:
            stopping.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
