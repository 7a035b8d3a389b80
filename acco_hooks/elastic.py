"""What a worker does when it loses a peer under torchrun's elastic agent.

Under ``torchrun --nnodes MIN:MAX --max-restarts R`` a lost node is the expected path: the
survivors' next collective fails, each survivor exits, and the agent restarts the workers on
the nodes that are left, which resume from the newest complete checkpoint. A traceback per
rank then reads like a crash. :func:`exit_for_restart` turns that case into one line per rank
that says what was lost, that the agent restarts the workers, and from which checkpoint they
resume, then exits with status 1 (what makes the agent restart them). Anything else, a failure
that is not a lost peer, no elastic agent, or no restart left, is left to the caller to
re-raise, traceback and all::

    try:
        train()
    except Exception as error:
        acco_hooks.elastic.exit_for_restart(error, resume_from=newest_checkpoint(root))
        raise
"""

from __future__ import annotations

import os
import re
import sys

__all__ = ["exit_for_restart", "lost_peer"]

# How a collective reports a peer that is gone, on gloo (its sockets closed or reset, or the
# group's timeout run out waiting for it) and NCCL (the communicator aborted by the watchdog).
_LOST_PEER_SIGNS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Read error",
    "Write error",
    "Timed out waiting",
    "did not finish within",  # the engine's own wait (CommWorker.wait)
    "communicator was aborted",
    "ncclRemoteError",
)


def lost_peer(error: BaseException) -> str | None:
    """What says a peer is gone (see ``_LOST_PEER_SIGNS``), from its sign to the end of its
    sentence, in the error or an error it was raised from; ``None`` if nothing does."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        for line in str(current).splitlines():
            for sign in _LOST_PEER_SIGNS:
                if sign in line:
                    said = line[line.index(sign) :]
                    return re.split(r"\. |; ", said, maxsplit=1)[0].rstrip(".")
        todo += [current.__cause__, current.__context__]
    return None


def exit_for_restart(error: BaseException, *, resume_from: str | os.PathLike | None) -> None:
    """Exit with status 1 after one line on stderr if ``error`` is a lost peer and torchrun's
    elastic agent will restart this worker; return otherwise (the caller re-raises).

    Args:
        error: what ended training on this rank.
        resume_from: the newest complete checkpoint, the one the restarted workers load;
            ``None`` if there is none yet (they start from the beginning).

    Example::

        except Exception as error:
            exit_for_restart(error, resume_from=newest_checkpoint(root))
            raise
    """
    cause = lost_peer(error)
    restarts = _restarts_left()
    if cause is None or restarts is None:
        return
    done, allowed = restarts
    print(
        f"acco_hooks: rank {os.environ.get('RANK', '?')}: lost a peer ({cause}); the elastic "
        f"agent restarts the workers (restart {done + 1} of {allowed}), which resume from "
        f"{resume_from if resume_from is not None else 'the start (no complete checkpoint yet)'}",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    raise SystemExit(1)


def _restarts_left() -> tuple[int, int] | None:
    """(restarts done, restarts allowed) under torchrun's elastic agent with one left."""
    try:
        done = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        allowed = int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
    except (KeyError, ValueError):
        return None
    return (done, allowed) if done < allowed else None

