"""The cold path, the coordinator's side: what a restart from a checkpoint needs to be decided.

Live recovery (a spare, state streamed from a peer) cannot serve every failure: two adjacent
ZeRO-1 ranks lost at once, a rank-local state whose mirror died with it, no spare at all, no
warm spare within --spare-wait. With `livemig run --checkpoint-dir`, such a failure restarts
the job from the newest complete checkpoint at the same world size instead of failing it
(docs/reliability.md, "The cold path"): this module says whether there is one to restart from
and how many restarts are left. No torch: it reads the directory's layout (livemig/checkpoints).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from livemig.checkpoint_dir import ENV_DIR, CheckpointError, choose, step_dir
from livemig.config import ENV_MAX_RESTARTS, ENV_RECOVERY
from livemig.errors import ConfigError
from livemig.rdzv.membership import Membership

log = logging.getLogger("livemig.coordinator.cold")
DEFAULT_MAX_RESTARTS = 3


def max_restarts_from_env() -> int:
    raw = os.environ.get(ENV_MAX_RESTARTS, "")
    try:
        n = int(raw) if raw else DEFAULT_MAX_RESTARTS
    except ValueError:
        raise ConfigError(f"{ENV_MAX_RESTARTS}={raw!r}: expected a whole number of restarts") from None
    if n < 0:
        raise ConfigError(f"--max-restarts {n}: expected 0 or more")
    return n


class ColdPath:
    """Owned by the Coordinator; remembers only the plan of the generation it decided for."""

    def __init__(self) -> None:
        self._env_dir = os.environ.get(ENV_DIR, "")
        self.dir = self._env_dir
        self.max_restarts = max_restarts_from_env()
        mode = os.environ.get(ENV_RECOVERY, "") or "live"
        if mode not in ("live", "cold"):
            raise ConfigError(f"--recovery {mode!r}: expected live (the default) or cold")
        # cold: live recovery off, every failure restarts from a checkpoint (to measure the cold
        # path, bench downtime's cold row, or to rehearse it before it is needed)
        self.forced = mode == "cold"
        self._plans: dict[int, dict[str, Any] | str] = {}

    def use_job_config(self, cfg: dict[str, Any] | None) -> None:
        """The directory the script set (`ctx.checkpoints`), which rank 0's signature record
        brought into the job's config, unless `livemig run --checkpoint-dir` gave one."""
        if not self._env_dir and cfg and isinstance(cfg.get("checkpoint_dir"), str):
            self.dir = cfg["checkpoint_dir"]

    def plan(self, m: Membership, why: str, committed: int | None = None,
             local_state: bool = False) -> dict[str, Any] | str:  # fmt: skip
        """{"path", "step", "redone"} of the restart generation m leads to, or the one line
        the job fails with (no checkpoint directory, none complete yet, restarts spent, one
        of another world size where rank-local state cannot be resharded; ZeRO-1 shards and
        replicated state are: runtime/checkpoint.load)."""
        got = self._plans.get(m.generation)
        if got is not None:
            return got
        if not self.dir:
            out: dict[str, Any] | str = f"{why}: restart from a checkpoint (run with --checkpoint-dir DIR " \
                                        "--checkpoint-every N to have it done automatically)"  # fmt: skip
        elif m.restarts >= self.max_restarts:
            out = f"{why}; the {m.restarts} cold restart(s) --max-restarts {self.max_restarts} allows are spent"
        else:
            try:
                chosen = choose(self.dir, deep=False)
            except CheckpointError as exc:
                chosen, why = None, f"{why}; {exc}"
            if chosen is None:
                out = f"{why}; no complete checkpoint in {self.dir} to restart from (the first is written " \
                      "after --checkpoint-every steps)"  # fmt: skip
            elif local_state and int(chosen[1].get("world", m.world_size)) != m.world_size:
                out = f"{why}; the newest complete checkpoint in {self.dir} (step {chosen[0]}) is of " \
                      f"{chosen[1]['world']} rank(s), and this job's rank-local state cannot be mapped to " \
                      f"its {m.world_size}"  # fmt: skip
            else:
                step = chosen[0]
                out = {"path": step_dir(self.dir, step), "step": step,
                       "redone": max(0, (committed if committed is not None else step) - step)}  # fmt: skip
        self._plans = {m.generation: out}
        return out
