"""The click options of the `pdserve` commands, built from the flags the config dataclasses
declare on their fields (common/flags.py), and `--help` printed in sections by concern.

Lifecycle: when pdserve/cli.py is imported, `specs(cls)` reads a config class's flags once into
`Spec`s and `options(specs)` decorates each command with them. In `pdserve launch`'s form of the
engine flags (`unset=True`) each defaults to None, "not given", so a worker keeps its own
default (shown in the help) and a cluster TOML's value stands. After parsing, `field_values`
turns a command's values into config fields, and `as_args` into the command line of the role
`pdserve launch` hands them to; `worker_args` does that for the engine flags, checked first by
building an `EngineConfig` (a bad value is a usage error before any process starts).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import click

from pdserve.common.flags import COMPUTED, FIELD_DEFAULT, GROUPS, Flag
from pdserve.runtime.config import EngineConfig
from pdserve_client.errors import PdserveError

SIMPLE = {"int": int, "float": float, "str": str, "bool": bool}  # field types a flag value sets as it is


@dataclass(frozen=True)
class Spec:
    """One field's flag, resolved: its click parameter name, value type and the commands' default."""

    field: str
    flag: Flag
    kind: str  # the field's type without "| None": int, float, str, bool, tuple[...] (typed LO:HI) or another class
    default: object  # the commands' default, as typed on the command line; None: none given

    @property
    def name(self) -> str:
        return self.flag.name or self.field

    @property
    def spelling(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def off_spelling(self) -> str:
        """A --NAME/--no-NAME pair's second spelling."""
        return "--no-" + self.name.replace("_", "-")

    @property
    def switch(self) -> bool:
        return self.kind == "bool" or self.flag.pair

    @property
    def negated(self) -> bool:
        """--no-NAME sets the field NAME to False."""
        return self.switch and not self.flag.pair and self.name.startswith("no_")


def specs(cls, launch_only: bool = False) -> list[Spec]:
    """The flags `cls` declares, in field order (`launch_only`: those `pdserve launch` takes too,
    under their launch names: `as_args` of those spells the launch's flag, not the role's)."""
    out = []
    for f in dataclasses.fields(cls):
        fl = f.metadata.get("flag")
        if fl is not None and (fl.launch or not launch_only):
            if launch_only and fl.launch_name:
                fl = dataclasses.replace(fl, name=fl.launch_name)
            kind = f.type.removesuffix(" | None")
            out.append(Spec(f.name, fl, kind, _command_default(f, fl, kind)))
    return out


def _command_default(f: dataclasses.Field, fl: Flag, kind: str):
    value = f.default if fl.command_default is FIELD_DEFAULT else fl.command_default
    if value is dataclasses.MISSING or value is COMPUTED:
        return () if fl.multiple else None
    if kind.startswith("tuple"):
        return ":".join(format(x, "g") for x in value)
    if kind == "bool" and fl.name.startswith("no_"):
        return not value
    return value if value is None or fl.scale == 1 else value // fl.scale


def _click_type(spec: Spec):
    fl = spec.flag
    if fl.choices:
        return click.Choice(list(fl.choices))
    if fl.existing_file:
        return click.Path(exists=True, dir_okay=False)
    base = SIMPLE.get(spec.kind, str)
    if fl.min is not None:
        return click.IntRange(fl.min) if base is int else click.FloatRange(fl.min)
    return base


class GroupedOption(click.Option):
    """A click option that knows its --help section (a runtime.flags.GROUPS name, or None: "Options")."""

    def __init__(self, *decls, group: str | None = None, **kw):
        super().__init__(*decls, **kw)
        self.group = group


class GroupedCommand(click.Command):
    """A command whose --help lists its own options first, then each group's in GROUPS order."""

    def format_options(self, ctx, formatter):
        sections: dict[str | None, list] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record:
                sections.setdefault(getattr(param, "group", None), []).append(record)
        for group in (None, *GROUPS):
            if group in sections:
                with formatter.section("Options" if group is None else group[0].upper() + group[1:]):
                    formatter.write_dl(sections[group])


def click_option(spec: Spec, unset: bool = False):
    """The click option of one flag; `unset`: default None, the role's default shown in the help."""
    fl = spec.flag
    decls = [f"{spec.spelling}/{spec.off_spelling}" if fl.pair else spec.spelling, *fl.aliases, spec.name]
    shown = spec.default not in (None, "", False, ())
    kw = dict(cls=GroupedOption, group=fl.group, multiple=fl.multiple, envvar=fl.envvar, default=None if unset else spec.default,
              help=f"{fl.help}  [default: {spec.default}]" if unset and shown else fl.help, show_default=shown and not unset)
    if not spec.switch:
        kw["type"] = _click_type(spec)
    elif not fl.pair:  # (a --NAME/--no-NAME pair is a switch by its spelling)
        kw["is_flag"] = True
    return click.option(*decls, **kw)


def options(spec_list: list[Spec], unset: bool = False):
    """Decorate a command with these flags, in this order."""
    def decorate(f):
        for spec in reversed(spec_list):
            f = click_option(spec, unset)(f)
        return f
    return decorate


def field_values(spec_list: list[Spec], values: dict) -> dict:
    """Config fields from parsed values: the flags given (not None) whose value the field takes as
    typed, scaled or negated; the rest (repeated, LO:HI, switches for objects) are the caller's."""
    out = {}
    for s in spec_list:
        value = values.get(s.name)
        if value is not None and s.kind in SIMPLE and not s.flag.multiple:
            out[s.field] = (not value) if s.negated else value * s.flag.scale if s.flag.scale != 1 else value
    return out


def as_args(spec_list: list[Spec], values: dict) -> list[str]:
    """The given values as the command line that sets them (None, an unset switch, nothing repeated: left out)."""
    args = []
    for s in spec_list:
        value = values.get(s.name)
        if value is None or (s.switch and not s.flag.pair and not value):
            continue
        if s.switch:
            args.append(s.spelling if value else s.off_spelling)
        else:
            args += [a for v in (value if s.flag.multiple else [value]) for a in (s.spelling, str(v))]
    return args


ENGINE_LAUNCH = specs(EngineConfig, launch_only=True)  # the engine flags `pdserve launch` passes to every worker


def worker_args(values: dict) -> list[str]:
    """The engine flags given to `pdserve launch`, checked, as worker command-line arguments; raises click.BadParameter."""
    given = {s.name: values[s.name] for s in ENGINE_LAUNCH if values.get(s.name) is not None}
    try:
        EngineConfig(**field_values(ENGINE_LAUNCH, given))
    except PdserveError as e:
        raise click.BadParameter(str(e)) from e
    return as_args(ENGINE_LAUNCH, given)
