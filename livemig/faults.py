"""Fault plans: `kill:rank=1:step=10`, `kill:rank=1:step=10:during=allreduce`,
`hang:rank=1:step=10[:resume=SECONDS]`, `drop_avg:rank=1:step=10`.

- kill / hang: the launcher SIGKILLs / SIGSTOPs the worker holding `rank`
  right after it reports committing `step` (hang with resume=S: SIGCONT
  after S seconds, to watch a fenced process stop itself).
- kill with during=allreduce: the worker kills itself inside ctx.step() of
  `step`, after its gradients entered the collective (a peer may complete).
- kill with during=before_commit: the worker kills itself after the
  collective of `step` completed, before its optimizer step.
- drop_avg: the worker discards its completed average of `step` and enters
  recovery as if its collective failed; combined with a kill at the same
  step this reproduces "the collective completed on some ranks only".
"""

from __future__ import annotations

from dataclasses import dataclass

from livemig.errors import ConfigError

KINDS = ("kill", "hang", "drop_avg")
DURING = ("allreduce", "before_commit", "")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    during: str = ""
    resume_after: float | None = None  # hang only: SIGCONT after this many seconds

    @property
    def in_process(self) -> bool:
        return self.kind == "drop_avg" or bool(self.during)

    def self_spec(self) -> str:
        """What the worker reads from LIVEMIG_SELF_FAULT."""
        kind = "selfkill" if self.kind == "kill" else self.kind
        return f"{kind}:step={self.step}:at={self.during or 'allreduce'}"


def parse_fault(spec: str) -> Fault:
    parts = spec.split(":")
    kind, fields = parts[0], {}
    for p in parts[1:]:
        k, sep, v = p.partition("=")
        if not sep:
            raise ConfigError(f"bad fault {spec!r}: expected KIND:rank=R:step=S[:during=allreduce]")
        fields[k] = v
    if kind not in KINDS:
        raise ConfigError(f"bad fault {spec!r}: kind must be one of {', '.join(KINDS)}")
    try:
        rank, step = int(fields.pop("rank")), int(fields.pop("step"))
    except (KeyError, ValueError):
        raise ConfigError(f"bad fault {spec!r}: rank=R and step=S are required integers") from None
    during = fields.pop("during", "")
    if during not in DURING:
        raise ConfigError(f"bad fault {spec!r}: during must be allreduce or before_commit")
    resume = fields.pop("resume", None)
    if resume is not None and kind != "hang":
        raise ConfigError(f"bad fault {spec!r}: resume=SECONDS applies to hang only")
    if fields:
        raise ConfigError(f"bad fault {spec!r}: unknown field(s) {', '.join(fields)}")
    if rank < 0 or step < 0:
        raise ConfigError(f"bad fault {spec!r}: rank and step must be >= 0")
    try:
        resume_after = float(resume) if resume is not None else None
    except ValueError:
        raise ConfigError(f"bad fault {spec!r}: resume must be a number of seconds") from None
    return Fault(kind, rank, step, during, resume_after)


def parse_self_fault(spec: str) -> tuple[str, int, str]:
    """LIVEMIG_SELF_FAULT -> (kind, step, at)."""
    kind, *rest = spec.split(":")
    fields = dict(p.partition("=")[::2] for p in rest)
    return kind, int(fields["step"]), fields.get("at", "allreduce")
