"""pdserve: the one import root of the engine.

Every shipped module imports as `pdserve.<package>`: the command line and launcher live here
(pdserve/cli.py, launch.py, bench/), the engine's packages in the design card's top-level folders
of the repository (common/, kernels/, runtime/, wire/, kvtransfer/, decode/, worker/, prefill/,
coordinator/, gateway/), which a wheel installs as pdserve/kernels/, pdserve/runtime/, ...
(pyproject.toml's package-dir). Those folders have no `__init__.py`: at the repository's top level
they are at most namespace portions, which lose to any installed package of the same name (say
Hugging Face's `kernels`), so Python started from the checkout never hands a third-party import one
of our folders. In a checkout (an editable install, or `python` run from the repository root)
this package's `__path__` also names the repository root, which is how `pdserve.kernels` finds
`kernels/` there; an installed wheel has the folders under pdserve/ and needs no such entry.
"""
from pathlib import Path as _Path

_here = _Path(__file__).resolve().parent
if not (_here / "runtime").is_dir() and (_here.parent / "runtime" / "engine.py").is_file():
    __path__.append(str(_here.parent))  # a checkout: pdserve.<package> -> <root>/<package>
del _Path, _here
