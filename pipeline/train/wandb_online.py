"""Whether wandb can log online, found out in a few seconds instead of inside ``wandb.init``.

Online without a key, ``wandb.init`` raises at once; online without a reachable server it retries for ~90 s
(``init_timeout``) and then raises; both after ``run_dir`` is written. So a run that asked for online logging
(``logging.wandb_mode=online``, or ``auto`` with ``WANDB_MODE=online``) is checked before any work and refused in
one line (`online_refusal`), and a run that ``auto`` sent online only because ``WANDB_API_KEY`` is set logs offline
instead when the server does not answer (`online_problem`, called where wandb starts). The probe is one HTTP
request to ``WANDB_BASE_URL`` (proxies from the environment, as wandb uses them), bounded as a whole, name lookup
included.
"""

from __future__ import annotations

import http.client
import netrc
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

PROBE_TIMEOUT_S = 5.0
"""How long the server may take to answer; a slow network costs this once, at the start."""
DEFAULT_SERVER = "https://api.wandb.ai"


def server_url(environ: Mapping[str, str]) -> str:
    return (environ.get("WANDB_BASE_URL") or DEFAULT_SERVER).rstrip("/")


def has_key(environ: Mapping[str, str], url: str) -> bool:
    """Whether wandb will find credentials: ``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE``, or an entry for the
    server in the netrc file (``$NETRC`` or ``~/.netrc``, where ``wandb login`` writes the key)."""
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    path = Path(environ.get("NETRC") or "~/.netrc").expanduser()
    try:
        entries = netrc.netrc(str(path))
    except (OSError, netrc.NetrcParseError):
        return False
    parts = urlsplit(url)
    return any(entries.authenticators(host) for host in (parts.netloc, parts.hostname) if host)


def server_unreachable(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why ``url`` gave no HTTP answer within ``timeout_s`` (None when it answered, with any status)."""
    outcome: list[str | None] = []
    silent = f"no answer within {timeout_s:g} s"

    def probe() -> None:
        try:
            urllib.request.urlopen(url, timeout=timeout_s).close()
            outcome.append(None)
        except urllib.error.HTTPError:
            outcome.append(None)  # an error status is still the server answering
        except urllib.error.URLError as err:
            outcome.append(silent if isinstance(err.reason, TimeoutError) else str(err.reason))
        except TimeoutError:
            outcome.append(silent)
        except (OSError, ValueError, http.client.HTTPException) as err:
            outcome.append(str(err) or type(err).__name__)

    # A thread, because the socket timeout does not bound the name lookup (which waits on an unreachable DNS
    # server); a probe still running after the bound is abandoned and ends at its own timeout.
    thread = threading.Thread(target=probe, name="wandb-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return outcome[0] if outcome else silent


def online_problem(environ: Mapping[str, str], timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """What keeps wandb from logging online (no key, or no answer from the server); None when nothing does."""
    url = server_url(environ)
    if not has_key(environ, url):
        return (
            f"no wandb API key for {url} (neither WANDB_API_KEY nor WANDB_IDENTITY_TOKEN_FILE is set, and the "
            "netrc file has no entry; `wandb login` writes one)"
        )
    reason = server_unreachable(url, timeout_s)
    if reason is not None:
        return f"the wandb server {url} (WANDB_BASE_URL) did not answer: {reason}"
    return None


def asked_online(setting: str, environ: Mapping[str, str]) -> str | None:
    """How online logging was asked for (``logging.wandb_mode=online``, or ``auto`` with ``WANDB_MODE=online``),
    or None: not at all, or only by ``auto`` finding ``WANDB_API_KEY`` set."""
    env_mode = environ.get("WANDB_MODE", "").strip().lower()
    if setting == "online":
        return "logging.wandb_mode=online"
    if setting == "auto" and env_mode in ("online", "run"):
        return f"logging.wandb_mode=auto with WANDB_MODE={env_mode}"
    return None


def online_refusal(setting: str, environ: Mapping[str, str]) -> str | None:
    """The one-line refusal for a run that asked for online logging when it cannot work; None otherwise."""
    asked = asked_online(setting, environ)
    problem = None if asked is None else online_problem(environ)
    if problem is None:
        return None
    return (
        f"{asked}, but {problem}; set logging.wandb_mode=offline (the run logs into <run_dir>/wandb; upload it "
        "later with `wandb sync`)"
    )
