"""Config values that name code: an algorithm's module (algorithm.name), a function of one's own
(algorithm.policy_loss), a refit transport (refit.transport) as "module:attribute". Every layer
that looks such a name up imports it the same way, from here: installed modules, and those in the
directory rlkit was started from."""

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Callable

from rlkit.config.schema import ConfigError


def start_directory_importable() -> None:
    """Modules in the directory rlkit was started from import too, so a user's my_env.py next to
    their recipe just works (Ray's workers have that directory on their path as well)."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


class NoSuchModule(Exception):
    """A module that a config value names does not exist."""


def import_named(module_name: str):
    """The module a config value names, found as rlkit finds environments' modules (installed, or
    in the directory rlkit was started from). NoSuchModule where it does not exist; where it exists
    but something it imports is missing, that ImportError: the user's to see, not "no module"."""
    start_directory_importable()
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        if e.name is not None and not module_name.startswith(e.name):
            raise
        raise NoSuchModule(str(e)) from None


def named_attribute(name: str, wrong: str, what: str, fits: Callable[[object], bool]):
    """What `name` ("module:attribute") names, where it `fits`; else `wrong` (the key's config error
    for a bad name), saying why: no ":", no such module, or no `what` of that name in it."""
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise ConfigError(wrong)
    try:
        found = getattr(import_named(module_name), attribute, None)
    except NoSuchModule as e:
        raise ConfigError(f"{wrong}; {e}") from None
    if not fits(found):
        raise ConfigError(f"{wrong}; module {module_name!r} defines no {what} {attribute!r}")
    return found


@dataclass(frozen=True)
class Lazy:
    """A spec's callable named as "module:attribute" (e.g. "rlkit.algorithms.policy_gradient:
    PolicyGradientTrainer"), imported at its first call, when the run starts, not when the
    config loads."""

    target: str

    def resolve(self):
        module, _, attribute = self.target.partition(":")
        return getattr(importlib.import_module(module), attribute)

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)
