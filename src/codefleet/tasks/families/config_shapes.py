"""The four code shapes of the `config` family, one per template.

Each shape is a small package whose defaults live in one place — Python
constants (`http_client`), a JSON file (`worker_pool`), dataclass defaults
(`cache`) or an INI file (`mailer`) — and are read by a few functions. A
`Setting` knows its default, some other values a request could ask for, a
prose phrase and a *probe*: the call whose result shows the value, so the
hidden tests check behaviour, not how the value was spelled. The visible
tests only check consistency (they pass with any values).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    key: str
    default: object
    choices: tuple
    phrase: str  # prose with {value}, e.g. "the request timeout should be {value} s"
    probe: tuple[str, str, tuple, tuple]  # (module in the package, function, args, keys into the result)


@dataclass(frozen=True)
class Shape:
    name: str
    packages: tuple[str, ...]
    topic: str  # "the HTTP client"
    where: str  # file that holds the defaults, relative to the package
    settings: tuple[Setting, ...]
    render: Callable[[str, dict], dict[str, str]]  # (package, {key: value}) -> files under the package
    visible_tests: str  # custom test source with {package}


def prose_value(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


# -- http_client: Python constants -------------------------------------------------------

_CLIENT = '''"""Request options and the retry policy, built from the defaults in settings."""

from {package} import settings


def retry_delays():
    """Seconds to wait before each retry: BACKOFF_BASE_S, doubling each time, DEFAULT_RETRIES of them."""
    return [settings.BACKOFF_BASE_S * 2 ** attempt for attempt in range(settings.DEFAULT_RETRIES)]


def retry_policy():
    """How failed requests are retried."""
    return {{"retries": settings.DEFAULT_RETRIES, "delays_s": retry_delays()}}


def request_options(url):
    """Keyword arguments for one request to `url`."""
    return {{
        "url": url,
        "timeout_s": settings.TIMEOUT_S,
        "max_redirects": settings.MAX_REDIRECTS,
        "headers": {{"User-Agent": settings.USER_AGENT}},
    }}


def pool_options():
    """Options of the connection pool."""
    return {{"max_connections": settings.POOL_SIZE, "block": False}}
'''


def _render_http(package: str, values: dict) -> dict[str, str]:
    lines = ['"""Defaults of the HTTP client. Every other module reads them from here."""\n', "\n"]
    lines += [f"{key} = {value!r}\n" for key, value in values.items()]
    return {"settings.py": "".join(lines), "client.py": _CLIENT.format(package=package)}


HTTP_CLIENT = Shape(
    "http_client",
    ("fetchkit", "http_helpers"),
    "the HTTP client",
    "settings.py",
    (
        Setting(
            "DEFAULT_RETRIES",
            3,
            (5, 4, 6),
            "the client should retry {value} times by default",
            ("client", "retry_policy", (), ("retries",)),
        ),
        Setting(
            "TIMEOUT_S",
            10.0,
            (30.0, 5.0, 15.0),
            "the request timeout should be {value} s",
            ("client", "request_options", ("https://example.com",), ("timeout_s",)),
        ),
        Setting(
            "BACKOFF_BASE_S",
            0.5,
            (1.0, 0.25, 2.0),
            "the first retry should wait {value} s (later waits keep doubling)",
            ("client", "retry_policy", (), ("delays_s", 0)),
        ),
        Setting(
            "MAX_REDIRECTS",
            5,
            (3, 10, 2),
            "at most {value} redirects should be followed",
            ("client", "request_options", ("https://example.com",), ("max_redirects",)),
        ),
        Setting(
            "USER_AGENT",
            "fetchkit/1.0",
            ("fetchkit/2.0", "acme-fetcher/1.0"),
            "requests should send the user agent `{value}`",
            ("client", "request_options", ("https://example.com",), ("headers", "User-Agent")),
        ),
        Setting(
            "POOL_SIZE",
            10,
            (20, 4, 50),
            "the connection pool should allow {value} connections",
            ("client", "pool_options", (), ("max_connections",)),
        ),
    ),
    _render_http,
    """
def test_one_delay_per_retry():
    assert len(retry_delays()) == settings.DEFAULT_RETRIES


def test_delays_double():
    delays = retry_delays()
    assert all(later == 2 * earlier for earlier, later in zip(delays, delays[1:]))


def test_request_options_follow_settings():
    options = request_options("https://example.com/a")
    assert options["url"] == "https://example.com/a"
    assert options["timeout_s"] == settings.TIMEOUT_S
""",
)
HTTP_CLIENT_IMPORTS = "from {package} import settings\nfrom {package}.client import request_options, retry_delays"

# -- worker_pool: JSON -------------------------------------------------------------------

_POOL_CONFIG = '''"""Reads the pool defaults from defaults.json, next to this file."""

import json
import pathlib

DEFAULTS_PATH = pathlib.Path(__file__).with_name("defaults.json")


def load_defaults():
    """The defaults as a dict (read again on every call)."""
    with open(DEFAULTS_PATH, encoding="utf-8") as f:
        return json.load(f)
'''
_POOL = '''"""Plans how jobs run on the worker pool, from the defaults in defaults.json."""

from {package}.config import load_defaults


def pool_plan(jobs):
    """Workers, queue size and number of batches for `jobs` jobs."""
    defaults = load_defaults()
    batches = -(-jobs // defaults["batch_size"])
    return {{"workers": defaults["workers"], "queue_size": defaults["queue_size"], "batches": batches}}


def logging_setup():
    """Logging configuration of the pool."""
    return {{"level": load_defaults()["log_level"], "format": "%(asctime)s %(levelname)s %(message)s"}}


def shutdown_grace_s():
    """Seconds the workers get to finish when the pool shuts down."""
    return load_defaults()["shutdown_grace_s"]
'''


def _render_pool(package: str, values: dict) -> dict[str, str]:
    return {
        "defaults.json": json.dumps(values, indent=2) + "\n",
        "config.py": _POOL_CONFIG,
        "pool.py": _POOL.format(package=package),
    }


WORKER_POOL = Shape(
    "worker_pool",
    ("jobrunner", "worker_pool"),
    "the worker pool",
    "defaults.json",
    (
        Setting(
            "workers",
            4,
            (8, 2, 16),
            "the pool should start {value} workers",
            ("pool", "pool_plan", (100,), ("workers",)),
        ),
        Setting(
            "queue_size",
            100,
            (250, 50, 1000),
            "the job queue should hold up to {value} jobs",
            ("pool", "pool_plan", (100,), ("queue_size",)),
        ),
        Setting(
            "batch_size",
            16,
            (8, 32, 20),
            "jobs should be processed in batches of {value}",
            ("pool", "pool_plan", (100,), ("batches",)),
        ),
        Setting(
            "log_level",
            "INFO",
            ("DEBUG", "WARNING"),
            "the default log level should be {value}",
            ("pool", "logging_setup", (), ("level",)),
        ),
        Setting(
            "shutdown_grace_s",
            5,
            (30, 10, 2),
            "on shutdown the workers should get {value} seconds to finish",
            ("pool", "shutdown_grace_s", (), ()),
        ),
    ),
    _render_pool,
    """
def test_defaults_have_every_key():
    assert set(load_defaults()) == {"workers", "queue_size", "batch_size", "log_level", "shutdown_grace_s"}


def test_plan_follows_defaults():
    defaults = load_defaults()
    plan = pool_plan(defaults["batch_size"] * 3)
    assert plan == {"workers": defaults["workers"], "queue_size": defaults["queue_size"], "batches": 3}


def test_log_level_is_a_level_name():
    assert logging_setup()["level"] in ("DEBUG", "INFO", "WARNING", "ERROR")
""",
)
WORKER_POOL_IMPORTS = "from {package}.config import load_defaults\nfrom {package}.pool import logging_setup, pool_plan"

# -- cache: dataclass defaults -------------------------------------------------------------

_CACHE = '''"""Describes the default cache built from CacheOptions."""

from {package}.options import CacheOptions


def describe():
    """The default cache setup as a plain dict."""
    options = CacheOptions()
    return {{"capacity": options.max_entries, "ttl_s": options.ttl_s, "policy": options.eviction,
            "shards": options.shards, "compressed": options.compress}}


def entries_per_shard():
    """How many entries each shard holds by default."""
    options = CacheOptions()
    return options.max_entries // options.shards
'''
_TYPES = {"max_entries": "int", "ttl_s": "int", "eviction": "str", "shards": "int", "compress": "bool"}


def _render_cache(package: str, values: dict) -> dict[str, str]:
    fields = "".join(f"    {key}: {_TYPES[key]} = {value!r}\n" for key, value in values.items())
    options = (
        '"""Tunables of the cache. The defaults below are what `CacheOptions()` gives."""\n\n'
        "from dataclasses import dataclass\n\n\n@dataclass\nclass CacheOptions:\n" + fields
    )
    return {"options.py": options, "cache.py": _CACHE.format(package=package)}


CACHE = Shape(
    "cache",
    ("cachekit", "memo_store"),
    "the cache",
    "options.py",
    (
        Setting(
            "max_entries",
            1000,
            (5000, 250, 2000),
            "the cache should hold {value} entries by default",
            ("cache", "describe", (), ("capacity",)),
        ),
        Setting(
            "ttl_s",
            300,
            (60, 900, 3600),
            "entries should expire after {value} seconds",
            ("cache", "describe", (), ("ttl_s",)),
        ),
        Setting(
            "eviction",
            "lru",
            ("lfu", "fifo"),
            "the eviction policy should be `{value}`",
            ("cache", "describe", (), ("policy",)),
        ),
        Setting(
            "shards",
            4,
            (8, 2, 16),
            "the cache should be split into {value} shards",
            ("cache", "describe", (), ("shards",)),
        ),
        Setting(
            "compress",
            False,
            (True,),
            "values should be compressed by default",
            ("cache", "describe", (), ("compressed",)),
        ),
    ),
    _render_cache,
    """
def test_describe_follows_options():
    options = CacheOptions()
    assert describe()["capacity"] == options.max_entries
    assert describe()["shards"] == options.shards


def test_entries_per_shard():
    options = CacheOptions()
    assert entries_per_shard() == options.max_entries // options.shards


def test_options_can_be_overridden():
    assert CacheOptions(ttl_s=1).ttl_s == 1
""",
)
CACHE_IMPORTS = "from {package}.cache import describe, entries_per_shard\nfrom {package}.options import CacheOptions"

# -- mailer: INI ---------------------------------------------------------------------------

_MAILER_SETTINGS = '''"""Reads mailer.ini (next to this file) into typed settings."""

import configparser
import pathlib

INI_PATH = pathlib.Path(__file__).with_name("mailer.ini")


def _parser():
    parser = configparser.ConfigParser()
    parser.read(INI_PATH, encoding="utf-8")
    return parser


def smtp_settings():
    """Host, port and whether to use TLS."""
    smtp = _parser()["smtp"]
    return {"host": smtp.get("host"), "port": smtp.getint("port"), "tls": smtp.getboolean("use_tls")}


def limits():
    """Sending limits."""
    section = _parser()["limits"]
    return {"max_recipients": section.getint("max_recipients"),
            "rate_per_minute": section.getint("rate_per_minute")}
'''


def _ini(value: object) -> str:
    return ("yes" if value else "no") if isinstance(value, bool) else str(value)


def _render_mailer(package: str, values: dict) -> dict[str, str]:
    ini = (
        "# Defaults of the mailer.\n\n[smtp]\n"
        f"host = {_ini(values['host'])}\nport = {_ini(values['port'])}\nuse_tls = {_ini(values['use_tls'])}\n\n"
        f"[limits]\nmax_recipients = {_ini(values['max_recipients'])}\n"
        f"rate_per_minute = {_ini(values['rate_per_minute'])}\n"
    )
    return {"mailer.ini": ini, "settings.py": _MAILER_SETTINGS}


MAILER = Shape(
    "mailer",
    ("mailroom", "notify_mail"),
    "the mailer",
    "mailer.ini",
    (
        Setting(
            "host",
            "localhost",
            ("smtp.example.com", "mail.internal"),
            "mail should go through the SMTP host `{value}`",
            ("settings", "smtp_settings", (), ("host",)),
        ),
        Setting(
            "port",
            25,
            (587, 465, 2525),
            "the SMTP port should be {value}",
            ("settings", "smtp_settings", (), ("port",)),
        ),
        Setting("use_tls", False, (True,), "connections should use TLS", ("settings", "smtp_settings", (), ("tls",))),
        Setting(
            "max_recipients",
            50,
            (100, 20, 10),
            "a message may have at most {value} recipients",
            ("settings", "limits", (), ("max_recipients",)),
        ),
        Setting(
            "rate_per_minute",
            30,
            (60, 10, 120),
            "at most {value} messages should go out per minute",
            ("settings", "limits", (), ("rate_per_minute",)),
        ),
    ),
    _render_mailer,
    """
def test_port_is_a_port_number():
    assert 0 < smtp_settings()["port"] < 65536


def test_limits_are_positive():
    assert all(value > 0 for value in limits().values())


def test_tls_is_a_boolean():
    assert isinstance(smtp_settings()["tls"], bool)
""",
)
MAILER_IMPORTS = "from {package}.settings import limits, smtp_settings"

SHAPES: dict[str, tuple[Shape, str]] = {  # name -> (shape, imports of its visible tests)
    "http_client": (HTTP_CLIENT, HTTP_CLIENT_IMPORTS),
    "worker_pool": (WORKER_POOL, WORKER_POOL_IMPORTS),
    "cache": (CACHE, CACHE_IMPORTS),
    "mailer": (MAILER, MAILER_IMPORTS),
}
