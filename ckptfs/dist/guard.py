"""Bounded waits: ckptfs's collectives run on gloo groups of their own, created with a timeout.

A save or load waits in collectives for the other ranks. On the caller's group such a wait is
bounded only by that group's timeout (30 minutes for gloo, 10 for NCCL), and NCCL does not even
notice a dead peer before it. So ckptfs talks over gloo groups it creates once per set of ranks,
lane and timeout (dist/groups.py): gloo reports a peer whose process died at once ("connection
closed by peer"), and a peer that is alive but never arrives (hung, or it never called
``save``) after ``timeout`` seconds. ``translate`` turns either into a ``CollectiveError``
naming the phase; the group is then forgotten (``groups.drop``) and the next save or load
creates a new one. A failure means a rank is dead or lost: the job's own process group is as
broken, and the job should restart.

Creating the group is itself collective (dist/groups.py) and bounded by the same timeout. This
module holds the timeout setting and the error translation; dist/groups.py owns the groups.
"""

from __future__ import annotations

import os

from ckptfs.errors import CollectiveError, ConfigError

#: seconds a rank waits for the others at one step of a save or load, unless configured
DEFAULT_TIMEOUT = 600.0
TIMEOUT_ENV = "CKPTFS_COLLECTIVE_TIMEOUT"


def collective_timeout(seconds: float | None = None) -> float:
    """The timeout to use: ``seconds``, else ``$CKPTFS_COLLECTIVE_TIMEOUT``, else 600 s."""
    if seconds is None:
        env = os.environ.get(TIMEOUT_ENV)
        try:
            seconds = float(env) if env else DEFAULT_TIMEOUT
        except ValueError:
            raise ConfigError(f"${TIMEOUT_ENV} must be a number of seconds, got {env!r}") from None
    if not seconds > 0:
        raise ConfigError(f"collective_timeout must be a positive number of seconds, got {seconds}")
    return float(seconds)


def translate(e: BaseException, what: str, timeout: float) -> CollectiveError:
    """The CollectiveError for a failed collective of phase ``what``."""
    text = str(e).split("\n")[0]
    low = text.lower()
    if "timed out" in low or "timeout" in low:
        why = (f"no answer from the other ranks within the collective timeout of {timeout:g} s: "
               f"a rank died, hangs, or never reached this step (collective_timeout= or "
               f"${TIMEOUT_ENV} sets the timeout)")
    elif "closed" in low or "reset" in low or "broken pipe" in low or "connection" in low:
        why = "a rank's process is gone (killed or crashed) or left this step after a failure"
    else:
        why = "the collective failed"
    return CollectiveError(what, f"{why} [{type(e).__name__}: {text}]")
