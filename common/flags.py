"""Command-line flags declared on the config dataclass fields they set, so that each flag's name,
help text, `--help` group and default are written once: the default is the field's own (or,
where the commands differ from in-process use, `command_default` beside it).

Lifecycle: `flag(...)` is called while a config class is defined (runtime/config.py,
coordinator/config.py, wire/limits.py, coordinator/planner.py, gateway/config.py) and stores a
frozen `Flag` in the field's metadata; pdserve/flags.py reads them to build the click options of
every command.
Nothing here imports click or torch: `pdserve --help` reads these without loading the engine.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# --help's sections, in order (options of one command alone come first, under "Options")
GROUPS = ("model and weights", "KV cache and transfer", "scheduling", "parallelism", "SLO", "paths and roles",
          "request limits", "network", "HTTP gateway", "Ray cluster", "security", "tracing")
FIELD_DEFAULT = object()  # command_default: the field's own default
COMPUTED = object()  # command_default: no fixed default, the command computes one at start (the help says how)


@dataclass(frozen=True)
class Flag:
    group: str  # one of GROUPS
    help: str
    name: str = ""  # the flag (and click parameter) where it is not the field's name: kv_cache_mb for kv_cache_bytes
    aliases: tuple[str, ...] = ()  # more spellings: "-q", "--max-batched-tokens"
    choices: tuple[str, ...] = ()
    min: float | None = None  # the smallest value taken
    scale: int = 1  # the field holds the flag's value times this (MiB -> bytes)
    command_default: object = FIELD_DEFAULT  # the commands' default where it is not the field's
    pair: bool = False  # a bool field spelled --NAME/--no-NAME
    multiple: bool = False  # may be given more than once
    existing_file: bool = False  # a path that must name a file that exists
    envvar: str | None = None
    launch: bool = False  # `pdserve launch` takes it too (and passes it on to the role that uses it)
    launch_name: str = ""  # its name on `pdserve launch` where the role's own would be ambiguous there (--http-host)

    def __post_init__(self):
        if self.group not in GROUPS:
            raise ValueError(f"flag group must be one of {', '.join(GROUPS)}, got {self.group!r}")


def flag(default=dataclasses.MISSING, *, factory=dataclasses.MISSING, **spec) -> dataclasses.Field:
    """A dataclass field with `default` (or `factory`) that a command-line flag sets; `spec`: Flag's fields."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"flag": Flag(**spec)})


def keys_flag(**spec) -> dataclasses.Field:
    """--keys: every role that opens a socket takes it."""
    return flag(None, group="security", help="CurveZMQ keys directory (pdserve keygen)", **spec)


def insecure_flag(**spec) -> dataclasses.Field:
    return flag(False, group="security", help="allow binding beyond loopback without CurveZMQ keys", **spec)

