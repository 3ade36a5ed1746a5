"""Source distributions from a package index, fetched as data: no code of the package runs on the host.

    path = fetch_sdist("six==1.16.0", cache_dir)                        # cache_dir/six-1.16.0/six-1.16.0.tar.gz
    path = fetch_sdist("six==1.16.0 --hash=sha256:1e61c374...", cache_dir)  # and it must have that sha256

`pip download --no-binary :all:` prepares a package's metadata by running its build backend (its setup.py,
or the backend its pyproject.toml names) on the host, so any package on an index could run code wherever
`tasks mine` runs. Here the index is read through its simple API instead, as data:

1. the indexes are pip's own: `index_urls` if given (`tasks mine --index-url`), else PIP_INDEX_URL or pip's
   configured `index-url` (else https://pypi.org/simple), then each `extra-index-url` (PIP_EXTRA_INDEX_URL or
   pip's config), asked in that order; the first that has the sdist serves it. `file://` indexes (a PEP 503
   tree of `index.html` pages) work too.
2. the project's page is asked for in PEP 691 JSON, PEP 503 HTML accepted; of its files, the one whose name
   is the sdist of exactly NAME==VERSION (`.tar.gz`, else `.zip`) is picked. Its link must be http(s)
   (or file:// on a file:// index) and the index must give its sha256: an index that gives none is refused.
3. it is downloaded with a size cap (Content-Length checked first, then the bytes as they come) into a
   temporary file beside the cache entry, its sha256 compared with the index's and with the caller's
   `--hash=sha256:` pins (pip's `--require-hashes`: any one of them must match), and only then renamed
   into place. A cached file is checked against the caller's pins again on every use.

Nothing is imported, built or unpacked here; the package's code only ever runs inside a sandbox, when
mining runs its tests.
"""

from __future__ import annotations

import hashlib
import html.parser
import json
import os
import re
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

DEFAULT_INDEX = "https://pypi.org/simple"
_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.!+_-]+)((?:\s+--hash[=\s]\S+)*)\s*")
_HASH = re.compile(r"--hash[=\s]sha256:([0-9a-fA-F]{64})")
_SDIST_SUFFIXES = (".tar.gz", ".zip")  # in order of preference
_MAX_PAGE_BYTES = 64 << 20
_TIMEOUT_S = 60
_MAX_DOWNLOAD_S = 900
_RAISE = "raise the cap (tasks mine --max-unpacked-mb, tasks fetch --max-mb)"
_ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"


class FetchError(RuntimeError):
    """A source distribution that cannot be fetched, or was not what its index or its pin said."""


@dataclass(frozen=True)
class Requirement:
    """NAME==VERSION, with the sha256 hashes one of which the sdist must have (none: the index's alone)."""

    name: str
    version: str
    sha256: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The project's normalized name (PEP 503)."""
        return re.sub(r"[-_.]+", "-", self.name).lower()

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"


def parse_requirement(text: str) -> Requirement | None:
    """`NAME==VERSION`, optionally followed by `--hash=sha256:HEX` (a requirements-file line); None otherwise."""
    match = _REQUIREMENT.fullmatch(text)
    if not match:
        return None
    hashes = _HASH.findall(match.group(3))
    if len(hashes) != match.group(3).count("--hash"):
        raise FetchError(f"{text.strip()!r}: only --hash=sha256:<64 hex digits> pins are understood")
    return Requirement(match.group(1), match.group(2), tuple(h.lower() for h in hashes))


def read_requirements(path: str) -> list[Requirement]:
    """The NAME==VERSION lines of a requirements file (comments and blank lines skipped). As with pip's
    --require-hashes, once one line pins a hash every line must."""
    with open(path, encoding="utf-8") as f:
        lines = [line.split(" #")[0].strip() for line in f]
    requirements = []
    for number, line in enumerate(lines, 1):
        if not line or line.startswith("#"):
            continue
        requirement = parse_requirement(line)
        if requirement is None:
            raise FetchError(f"{path}:{number}: {line!r} is not NAME==VERSION [--hash=sha256:HEX]")
        requirements.append(requirement)
    unpinned = [str(r) for r in requirements if not r.sha256]
    if unpinned and len(unpinned) < len(requirements):
        raise FetchError(
            f"{path}: some lines pin a sha256 and {', '.join(unpinned)} do not; pin every line "
            "(as pip's --require-hashes asks)"
        )
    return requirements


# -- where pip looks ------------------------------------------------------------------


def _pip_config() -> dict[str, str]:
    """pip's effective settings ({name: value}) from its config files and PIP_* variables; {} without pip."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    rank = {":env:": 3, "download": 2, "global": 1}  # what pip itself lets win
    found: dict[str, tuple[int, str]] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        section, _, name = key.strip().partition(".")
        if sep and section in rank and rank[section] >= found.get(name, (0, ""))[0]:
            found[name] = (rank[section], value.strip().strip("'\""))
    return {name: value for name, (_, value) in found.items()}


def pip_indexes() -> tuple[list[str], str | None]:
    """(the indexes pip would ask, primary first; the CA bundle pip is told to use, if any)."""
    config = _pip_config()
    primary = os.environ.get("PIP_INDEX_URL") or config.get("index-url") or DEFAULT_INDEX
    extra = (os.environ.get("PIP_EXTRA_INDEX_URL") or config.get("extra-index-url") or "").split()
    return [primary] + [url for url in extra if url != primary], os.environ.get("PIP_CERT") or config.get("cert")


def _shown(url: str) -> str:
    """A URL without any user:password in it, for messages."""
    parts = urllib.parse.urlsplit(url)
    if not (parts.username or parts.password):
        return url
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


# -- reading the index ----------------------------------------------------------------


class _NotFound(Exception):
    pass


def _open(url: str, accept: str, cafile: str | None):
    """(a response to read, its final URL, its content type) for an http(s) or file:// URL."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file":
        path = urllib.request.url2pathname(urllib.parse.unquote(parts.path))
        if os.path.isdir(path):
            path = os.path.join(path, "index.html")
        if not os.path.isfile(path):
            raise _NotFound(url)
        return open(path, "rb"), url, "text/html" if path.endswith(".html") else "application/octet-stream"
    if parts.scheme not in ("http", "https"):
        raise FetchError(f"{_shown(url)} is neither http(s) nor file://; codefleet reads indexes over those only")
    request = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": "codefleet-tasks-fetch"})
    context = ssl.create_default_context(cafile=cafile) if parts.scheme == "https" else None
    try:
        response = urllib.request.urlopen(request, timeout=_TIMEOUT_S, context=context)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise _NotFound(url) from None
        raise FetchError(f"{_shown(url)} answered HTTP {e.code} ({e.reason}); check the index URL") from None
    return response, response.geturl(), response.headers.get("Content-Type", "")


def _read_capped(f, max_bytes: int, what: str) -> bytes:
    data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise FetchError(f"{what} is larger than {max_bytes >> 20} MiB; not reading it")
    return data


class _Links(html.parser.HTMLParser):
    """The anchors of a PEP 503 page: [(href, text)]."""

    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href, self._text = dict(attrs).get("href") or "", []

    def handle_data(self, data):
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def _files(page: bytes, page_url: str, content_type: str) -> list[tuple[str, str, str | None]]:
    """(file name, absolute URL, sha256 or None) of every file a project page lists."""
    if "json" in content_type:
        try:
            listed = json.loads(page)["files"]
            return [
                (
                    str(f["filename"]),
                    urllib.parse.urljoin(page_url, str(f["url"])),
                    (f.get("hashes") or {}).get("sha256"),
                )
                for f in listed
            ]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise FetchError(f"{_shown(page_url)} is not a PEP 691 project page ({e})") from None
    parser = _Links()
    parser.feed(page.decode("utf-8", "replace"))
    found = []
    for href, text in parser.links:
        url = urllib.parse.urljoin(page_url, href)
        fragment = urllib.parse.urlsplit(url).fragment
        digest = re.fullmatch(r"sha256=([0-9a-fA-F]{64})", fragment)
        name = text or urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
        found.append((name, url, digest.group(1).lower() if digest else None))
    return found


def sdist_suffix(filename: str, requirement: Requirement) -> str | None:
    """The suffix of `filename` if it names the sdist of exactly `requirement` (PEP 625, or the older
    `<name>-<version>.tar.gz|.zip`); None otherwise. Such a name is a safe file name."""
    if not re.fullmatch(r"[A-Za-z0-9._!+-]+", filename):
        return None
    for suffix in _SDIST_SUFFIXES:
        stem = filename[: -len(suffix)] if filename.lower().endswith(suffix) else None
        tail = "-" + requirement.version.lower()
        if (
            stem
            and stem.lower().endswith(tail)
            and re.sub(r"[-_.]+", "-", stem[: -len(tail)]).lower() == requirement.key
        ):
            return suffix
    return None


def _find(requirement: Requirement, index: str, cafile: str | None) -> tuple[str, str, str] | None:
    """(file name, URL, sha256) of the sdist on `index`; None if the index does not have it."""
    page_url = index.rstrip("/") + f"/{requirement.key}/"
    try:
        response, final_url, content_type = _open(page_url, _ACCEPT, cafile)
    except _NotFound:
        return None
    except (urllib.error.URLError, OSError) as e:
        raise FetchError(
            f"could not read {_shown(page_url)} ({getattr(e, 'reason', e)}); check the network and "
            "the index URL (pip config list)"
        ) from None
    with response:
        page = _read_capped(response, _MAX_PAGE_BYTES, _shown(page_url))
    candidates = [
        (sdist_suffix(name, requirement), name, url, digest)
        for name, url, digest in _files(page, final_url, content_type)
    ]
    candidates = [c for c in candidates if c[0]]
    if not candidates:
        return None
    _, name, url, digest = min(candidates, key=lambda c: _SDIST_SUFFIXES.index(c[0]))
    allowed = ("http", "https", "file") if urllib.parse.urlsplit(final_url).scheme == "file" else ("http", "https")
    if urllib.parse.urlsplit(url).scheme not in allowed:
        raise FetchError(f"{_shown(index)} links {name} to {_shown(url)!r}, which is not http(s); refusing it")
    if digest is None:
        raise FetchError(
            f"{_shown(index)} gives no sha256 for {name}, so its download cannot be checked; use an "
            "index that does (PyPI does)"
        )
    return name, urllib.parse.urlsplit(url)._replace(fragment="").geturl(), digest


# -- downloading ----------------------------------------------------------------------


def _sha256(path: str) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def _download(url: str, dest_dir: str, name: str, expected: str, max_bytes: int, cafile: str | None) -> str:
    try:
        response, _, _ = _open(url, "*/*", cafile)
    except _NotFound:
        raise FetchError(f"{_shown(url)} is not there (404) although the index lists it; try again later") from None
    except (urllib.error.URLError, OSError) as e:
        raise FetchError(f"could not download {_shown(url)} ({getattr(e, 'reason', e)}); check the network") from None
    fd, part = tempfile.mkstemp(prefix=".part-", dir=dest_dir)
    try:
        with response, os.fdopen(fd, "wb") as out:
            headers = getattr(response, "headers", None)  # a file:// download has none
            length = headers.get("Content-Length") if headers else None
            if length and length.isdigit() and int(length) > max_bytes:
                raise FetchError(
                    f"{name} is {int(length) >> 20} MiB, more than the cap of {max_bytes >> 20} MiB; "
                    f"if it is genuine, {_RAISE}"
                )
            sha, size, deadline = hashlib.sha256(), 0, time.monotonic() + _MAX_DOWNLOAD_S
            while chunk := response.read(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise FetchError(
                        f"{name} is larger than the cap of {max_bytes >> 20} MiB; if it is genuine, {_RAISE}"
                    )
                if time.monotonic() > deadline:
                    raise FetchError(f"downloading {name} took more than {_MAX_DOWNLOAD_S} s; try again later")
                sha.update(chunk)
                out.write(chunk)
        if sha.hexdigest() != expected:
            raise FetchError(
                f"{name} from {_shown(url)} has sha256 {sha.hexdigest()}, not {expected} as expected; "
                "not using it (a corrupted or tampered download)"
            )
        path = os.path.join(dest_dir, name)
        os.chmod(part, 0o644)
        os.replace(part, path)
        return path
    except (urllib.error.URLError, OSError) as e:
        raise FetchError(f"could not download {_shown(url)} ({getattr(e, 'reason', e)}); check the network") from None
    finally:
        if os.path.exists(part):
            os.unlink(part)


def download_sdist(
    requirement: Requirement, dest_dir: str, index_urls: list[str] | None = None, max_bytes: int = 256 << 20
) -> str:
    """The sdist of `requirement` in `dest_dir` (downloaded unless a file of its name is there); its path."""
    os.makedirs(dest_dir, exist_ok=True)
    cached = sorted(
        n
        for n in os.listdir(dest_dir)
        if sdist_suffix(n, requirement)
        and os.path.isfile(os.path.join(dest_dir, n))
        and not os.path.islink(os.path.join(dest_dir, n))
    )
    if cached:
        path = os.path.join(dest_dir, cached[0])
        if requirement.sha256 and _sha256(path) not in requirement.sha256:
            raise FetchError(
                f"the cached {path} does not have the sha256 {requirement} is pinned to; delete it to download it again"
            )
        return path
    cafile = None
    if index_urls is None:
        index_urls, cafile = pip_indexes()
    for index in index_urls:
        found = _find(requirement, index, cafile)
        if found is None:
            continue
        name, url, digest = found
        if requirement.sha256 and digest not in requirement.sha256:
            raise FetchError(
                f"{_shown(index)} gives {name} the sha256 {digest}, which is not the one {requirement} "
                "is pinned to; not downloading it"
            )
        return _download(url, dest_dir, name, digest, max_bytes, cafile)
    raise FetchError(
        f"no source distribution (.tar.gz or .zip) of {requirement} on "
        f"{', '.join(_shown(i) for i in index_urls)}; check the name and the version (codefleet "
        "mines sdists, never wheels)"
    )


def fetch_sdist(
    requirement: str | Requirement, cache_dir: str, index_urls: list[str] | None = None, max_bytes: int = 256 << 20
) -> str:
    """`NAME==VERSION [--hash=sha256:HEX]` as its sdist, downloaded once into `cache_dir/<name>-<version>/`."""
    if isinstance(requirement, str):
        parsed = parse_requirement(requirement)
        if parsed is None:
            raise FetchError(f"{requirement!r} is not NAME==VERSION [--hash=sha256:HEX]")
        requirement = parsed
    return download_sdist(
        requirement, os.path.join(cache_dir, f"{requirement.key}-{requirement.version}"), index_urls, max_bytes
    )
