"""The flags a verdict can raise, the family each belongs to, and what to do about each.

A flag is a string (`"DEAD"`, `"DEAD_CHANNELS(3)"`), so it prints, compares and goes into
JSON as itself; `.name` is the flag without its count and `.n` the count, when it has one.
"""

from __future__ import annotations


class Flag(str):
    """One finding about one place: `Flag("DEAD")`, `Flag("DEAD_CHANNELS", 3)`.

    Refuses a name it does not know, and a count on a flag that takes none (or none on one
    that takes one).
    """

    name: str
    n: int | None

    def __new__(cls, name: str, n: int | None = None) -> Flag:
        if not isinstance(name, str):
            raise TypeError(f"a flag is a name such as 'DEAD' or 'DEAD_CHANNELS(3)', not {name!r}")
        if "(" in name and n is None:
            name, _, rest = name.partition("(")
            count = rest.rstrip(")")
            if not count.isdigit():
                raise ValueError(f"{name} takes a count, e.g. {name}(3), not {count!r}")
            n = int(count)
        if name not in _FAMILY:
            raise ValueError(f"unknown flag {name!r}; the flags are {sorted(_FAMILY)}")
        counted = name in ("DEAD_CHANNELS", "IGNORED_CHANNELS")
        if counted != (n is not None):
            raise ValueError(
                f"{name} takes a count, e.g. {name}(3)" if counted else f"{name} takes no count"
            )
        self = super().__new__(cls, f"{name}({n})" if counted else name)
        self.name = name
        self.n = n
        return self

    def __reduce__(self):  # noqa: ANN204
        return (Flag, (self.name, self.n))


_FLAGS_OF = {
    "numeric": ("NAN", "INF"),
    "signal": ("VANISHING", "EXPLODING"),
    "activation": ("DEAD", "SATURATED"),
    "step": ("STALLED", "OVERSTEPPING"),
    "capacity": ("DEAD_CHANNELS", "IGNORED_CHANNELS", "LEAKAGE", "NARROWING"),
}
FAMILIES = tuple(_FLAGS_OF)
_FAMILY = {name: fam for fam, names in _FLAGS_OF.items() for name in names}

_ABOUT = {
    "NAN": "A value here became NaN: look for a division by zero, a log of a non-positive "
    "number or a learning rate that blew up, and check the inputs for NaN.",
    "INF": "A value here overflowed to infinity: lower the learning rate, clip gradients, or "
    "compute in a wider dtype.",
    "VANISHING": "Almost no gradient reaches these weights: use a non-saturating activation, "
    "residual connections or normalisation, or a better-scaled initialisation.",
    "EXPLODING": "The gradient here is huge: clip gradients, lower the learning rate, or scale "
    "the initialisation down (He/Xavier for this activation).",
    "DEAD": "Nearly every output here is zero: the units are dead (often ReLUs pushed "
    "negative); lower the learning rate, use LeakyReLU/GELU, or check the bias initialisation.",
    "SATURATED": "Most outputs sit where the activation is flat, so no gradient passes: scale "
    "the inputs or the initialisation down, or normalise before the activation.",
    "STALLED": "The weights here barely move from step to step: raise the learning rate, or "
    "check that these parameters are in the optimizer and get a gradient.",
    "OVERSTEPPING": "Each step changes these weights by a large fraction of their size: lower "
    "the learning rate or add warm-up.",
    "DEAD_CHANNELS": "Some channels never activate over the window: they cost compute and learn "
    "nothing; reinitialise them or use a leaky activation.",
    "IGNORED_CHANNELS": "Most of the channels coming into this place get almost no gradient: "
    "it ignores them; look for a mask, a slice or a bug that drops them, or feed it fewer.",
    "LEAKAGE": "Channel groups declared apart carry nearly the same information (high CKA): "
    "whatever should keep them separate is not doing it.",
    "NARROWING": "The representation here has come to span very few directions (its effective "
    "rank fell from where it started): the layer is collapsing; check normalisation, learning "
    "rate and weight decay.",
}


def about(flag: str) -> str:
    """What a flag means and what to try, in one sentence. Refuses an unknown flag."""
    return _ABOUT[Flag(flag).name]


def family(flag: str) -> str:
    """Which family a flag is in: numeric, signal, activation, step or capacity."""
    return _FAMILY[Flag(flag).name]


NAN = Flag("NAN")
INF = Flag("INF")
VANISHING = Flag("VANISHING")
EXPLODING = Flag("EXPLODING")
DEAD = Flag("DEAD")
SATURATED = Flag("SATURATED")
STALLED = Flag("STALLED")
OVERSTEPPING = Flag("OVERSTEPPING")
LEAKAGE = Flag("LEAKAGE")
NARROWING = Flag("NARROWING")


def DEAD_CHANNELS(n: int) -> Flag:  # noqa: N802  (named as the flag it makes)
    """The flag for `n` channels that never activate."""
    return Flag("DEAD_CHANNELS", int(n))


def IGNORED_CHANNELS(n: int) -> Flag:  # noqa: N802
    """The flag for `n` dormant channels."""
    return Flag("IGNORED_CHANNELS", int(n))
