"""Robustness of the partition schemes: on any parameters and any small label array, ``parse_partition`` +
``split`` either return a valid partition or raise a one-line ConfigError naming the parameter; never another
exception, never a hang (every example runs under a time limit, so a hang fails instead of blocking CI).
"""

from __future__ import annotations

import re
import signal
import warnings

import fedtest
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedmosaic.data.partition import SCHEMES, Dirichlet, parse_partition
from fedmosaic.data.partition import dirichlet as dirichlet_module
from fedmosaic.data.partition.base import largest_remainder
from fedmosaic.errors import ConfigError

pytestmark = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer (POSIX)")


def time_limit():
    """A hang guard only: no example's speed is asserted."""
    return fedtest.time_limit(fedtest.HANG_S)


def rng(seed=0):
    return np.random.default_rng(seed)


# A ConfigError names what is wrong first: a scheme parameter, the client count, the labels or the groups.
ERROR = re.compile(r"^(partition(\.[A-Za-z_]\w*)?|n_clients|labels|groups): \S")


def assert_config_error(err: ConfigError) -> None:
    message = str(err)
    assert "\n" not in message and "\r" not in message, message
    assert ERROR.match(message), message


def assert_partition(parts, n_samples: int, n_clients: int, covers: bool) -> None:
    """n sorted, disjoint int64 index arrays within range; together every sample when ``covers``."""
    assert isinstance(parts, list) and len(parts) == n_clients
    seen = np.zeros(n_samples, dtype=bool)
    for p in parts:
        assert isinstance(p, np.ndarray) and p.ndim == 1 and p.dtype == np.int64
        assert np.all(np.diff(p) > 0), "not sorted or repeated"
        if len(p):
            assert 0 <= p[0] and p[-1] < n_samples, "index out of range"
        assert not seen[p].any(), "parts overlap"
        seen[p] = True
    if covers:
        assert seen.all(), f"{n_samples - seen.sum()} samples dropped"


# ---- strategies -------------------------------------------------------------------------------------------

MISSING = object()
JUNK = st.sampled_from(
    [0, -1, -0.0, -2.5, 5e-324, 1e-320, 1e-300, 1e300, 1.7e308, 2**63, 10**30, 10**7 + 1, 10**6 + 1]
    + [float("inf"), float("-inf"), float("nan"), True, False, "3", "0.1", "", None, [1], {"a": 1}]
)
SMALL_FLOATS = st.floats(1e-3, 10, allow_nan=False, allow_infinity=False)
VALID = {
    "alpha": SMALL_FLOATS | st.sampled_from([1, 1e-320, 1e-300, 1e-6, 1e3, 1e6]),
    "min_size": st.integers(0, 6),
    "max_retries": st.sampled_from([1, 2, 3, 5, 10, 30, 100]),
    "shards_per_client": st.integers(1, 4),
    "k": st.integers(1, 4),
    "balanced": st.booleans(),
    "distribution": st.sampled_from(["lognormal", "power_law"]),
    "sigma": SMALL_FLOATS | st.sampled_from([1e-300, 20.0, 20]),
    "exponent": SMALL_FLOATS | st.sampled_from([0.05, 1e6]),
    "users": st.integers(1, 30),
    "classes_per_user": st.integers(1, 4),
    "first": st.integers(0, 4),
    "drop_remainder": st.booleans(),
    "mean": st.floats(-100, 100) | st.sampled_from([-100.0, 100]),
    "offset": st.floats(0, 100) | st.sampled_from([0, 1e7]),
    "min_per_class": st.integers(0, 5) | st.just(10**7),
    "sizes": st.lists(st.integers(1, 30), min_size=1, max_size=5),
    "test_sizes": st.lists(st.integers(1, 30), min_size=1, max_size=5),
}
LABEL_VALUES = [0, 1, 2, 3, 7, 10**9, 2**62]


def draw_params(data, name: str) -> dict:
    fields = [f for f in SCHEMES[name].model_fields if f != "scheme"]
    only_valid = data.draw(st.booleans(), label="only_valid")
    params = {"scheme": name}
    for f in fields:
        options = [st.just(MISSING), VALID[f]] + ([] if only_valid else [JUNK])
        value = data.draw(st.one_of(*options), label=f)
        if value is not MISSING:
            params[f] = value
    if not only_valid and data.draw(st.integers(0, 9)) == 0:
        params["bogus"] = 1
    return params


def draw_labels(data, sane: bool) -> np.ndarray:
    if not sane and data.draw(st.integers(0, 3), label="labels_kind") == 0:  # not 1-D non-negative integers
        malformed = [np.zeros(4), np.zeros((2, 3), dtype=int), np.array([-1, 0]), "abc"]
        return data.draw(st.sampled_from(malformed), label="malformed")
    pool = st.lists(st.sampled_from(LABEL_VALUES), min_size=1, max_size=4, unique=True)
    pool = data.draw(pool, label="pool")
    values = st.lists(st.sampled_from(pool), min_size=10 if sane else 0, max_size=80)
    values = data.draw(values, label="labels")
    return np.array(values, dtype=np.int64)


def draw_n_clients(data, name: str, sane: bool):
    fixed = name in ("apfl_mnist", "femnist_lognormal", "natural", "domains")
    if sane:
        return None if fixed else data.draw(st.integers(1, 6), label="n_clients")
    odd = st.none() | st.integers(-2, 12) | st.sampled_from([10**12, True, 2.0])
    return data.draw(odd, label="n_clients")


def draw_groups(data, n_labels: int, sane: bool):
    matching = st.lists(st.integers(0, 4), min_size=n_labels, max_size=n_labels).map(np.array)
    if sane:
        return data.draw(matching, label="groups")
    wrong_length = st.lists(st.integers(0, 4), max_size=3).map(np.array)
    return data.draw(st.none() | matching | wrong_length, label="groups")


def check_scheme_properties(scheme, parts, labels) -> None:
    sizes = np.array([len(p) for p in parts])
    if scheme.scheme in ("dirichlet", "quantity"):
        assert sizes.min() >= scheme.min_size
    elif scheme.scheme == "iid":
        assert sizes.max() - sizes.min() <= 1
    elif scheme.scheme == "label_k":
        assert all(len(np.unique(labels[p])) == scheme.k for p in parts)
    elif scheme.scheme == "shards":
        assert all(len(np.unique(labels[p])) <= scheme.shards_per_client for p in parts)


def covers(scheme, labels) -> bool:
    """Whether the scheme's docstring promises every sample is assigned."""
    if scheme.scheme == "apfl_mnist":  # classes that no user holds are dropped
        n_classes = len(np.unique(labels))
        return not scheme.drop_remainder and scheme.users + scheme.classes_per_user - 1 >= n_classes
    if scheme.scheme == "domains":  # private sizes keep a subset of each domain
        return scheme.sizes is None
    return scheme.scheme not in ("label_k", "femnist_lognormal")


# ---- the property -----------------------------------------------------------------------------------------

PROPERTY_SETTINGS = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMES))
@PROPERTY_SETTINGS
@given(data=st.data())
def test_any_input_gives_a_partition_or_a_one_line_config_error(name, data):
    params = draw_params(data, name)
    sane = data.draw(st.booleans(), label="sane")  # well-formed labels, client count and groups
    labels = draw_labels(data, sane)
    n_labels = len(labels) if isinstance(labels, np.ndarray) and labels.ndim == 1 else 4
    n_clients = draw_n_clients(data, name, sane)
    groups = draw_groups(data, n_labels, sane)
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    paired = name == "shards" and data.draw(st.booleans(), label="paired")
    test_labels = draw_labels(data, sane) if paired else None

    with time_limit(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # NaN/overflow arithmetic is a bug, not a result
        try:
            scheme = parse_partition(params)
            if paired:
                parts, test_parts = scheme.split_paired(labels, test_labels, n_clients, rng(seed), groups)
            else:
                parts = scheme.split(labels, n_clients, rng(seed), groups)
        except ConfigError as err:
            assert_config_error(err)
            return
    n = scheme.num_clients(n_clients, groups)
    assert_partition(parts, len(labels), n, covers(scheme, labels))
    check_scheme_properties(scheme, parts, labels)
    if paired:
        assert_partition(test_parts, len(test_labels), n, covers=True)


# ---- direct regressions -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, shown", [(float("inf"), "inf"), (float("-inf"), "-inf"), (float("nan"), "nan")]
)
def test_non_finite_alpha_is_a_config_error(value, shown):
    # alpha=inf used to be accepted, and split then looped forever in the Dirichlet repair.
    with pytest.raises(ConfigError) as info:
        parse_partition({"scheme": "dirichlet", "alpha": value})
    assert str(info.value) == f"partition.alpha: must be a finite number (got {shown})"


FLOAT_FIELDS = [
    (name, f)
    for name, cls in sorted(SCHEMES.items())
    for f, info in cls.model_fields.items()
    if info.annotation is float
]
INT_FIELDS = [
    (name, f)
    for name, cls in sorted(SCHEMES.items())
    for f, info in cls.model_fields.items()
    if info.annotation is int
]


@pytest.mark.parametrize("name, field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_every_float_parameter_rejects_non_finite(name, field, value):
    with pytest.raises(ConfigError, match=rf"^data\.partition\.{field}: must be a finite number \(got "):
        parse_partition({"scheme": name, field: value}, prefix="data.partition")


@pytest.mark.parametrize("name, field", FLOAT_FIELDS)
def test_float_parameters_take_ints_but_not_bools_or_strings(name, field):
    value = parse_partition({"scheme": name, field: 1}).model_dump()[field]
    assert value == 1.0 and isinstance(value, float)
    with pytest.raises(ConfigError, match=rf"^partition\.{field}: must be a number \(got True\)$"):
        parse_partition({"scheme": name, field: True})
    not_a_string = rf"^partition\.{field}: must be a number, not a string \(got '1'\)$"
    with pytest.raises(ConfigError, match=not_a_string):
        parse_partition({"scheme": name, field: "1"})


@pytest.mark.parametrize("name, field", INT_FIELDS)
def test_int_parameters_are_strict_and_bounded(name, field):
    with pytest.raises(ConfigError, match=rf"^partition\.{field}: must be an integer \(got True\)$"):
        parse_partition({"scheme": name, field: True})
    not_a_string = rf"^partition\.{field}: must be an integer, not a string \(got '3'\)$"
    with pytest.raises(ConfigError, match=not_a_string):
        parse_partition({"scheme": name, field: "3"})
    with pytest.raises(ConfigError, match=rf"^partition\.{field}: must be an integer \(got 3\.0\)$"):
        parse_partition({"scheme": name, field: 3.0})
    with pytest.raises(ConfigError, match=rf"^partition\.{field}: must be <= \d+ \(got ~1e5000\)$"):
        parse_partition({"scheme": name, field: 10**5000})
    # numpy integers (e.g. from a sweep over np.arange) are integers
    assert getattr(parse_partition({"scheme": name, field: np.int64(3)}), field) == 3


@pytest.mark.parametrize(
    "name, field, largest",
    [
        ("dirichlet", "alpha", 1e6),
        ("dirichlet", "min_size", 10**7),
        ("dirichlet", "max_retries", 10**4),
        ("shards", "shards_per_client", 10**6),
        ("label_k", "k", 10**6),
        ("quantity", "sigma", 20.0),
        ("quantity", "exponent", 1e6),
        ("quantity", "min_size", 10**7),
        ("apfl_mnist", "users", 10**6),
        ("apfl_mnist", "classes_per_user", 10**6),
        ("apfl_mnist", "first", 10**7),
        ("apfl_mnist", "sigma", 20.0),
        ("femnist_lognormal", "users", 10**6),
        ("femnist_lognormal", "mean", 100.0),
        ("femnist_lognormal", "sigma", 20.0),
        ("femnist_lognormal", "offset", 10**7),
        ("femnist_lognormal", "min_per_class", 10**7),
    ],
)
def test_numeric_parameters_have_an_upper_bound(name, field, largest):
    assert getattr(parse_partition({"scheme": name, field: largest}), field) == largest
    too_big = largest * 10
    with pytest.raises(ConfigError, match=rf"^partition\.{field}: must be <= "):
        parse_partition({"scheme": name, field: too_big})


def test_yaml_exponent_strings_get_a_hint():
    # PyYAML reads `alpha: 1e-3` as the string '1e-3'; strict parsing rejects it, so the message says why.
    with pytest.raises(ConfigError) as info:
        parse_partition({"scheme": "dirichlet", "alpha": "1e-3"}, prefix="data.partition")
    assert str(info.value) == (
        "data.partition.alpha: must be a number, not a string (got '1e-3'); "
        "YAML reads 1e-3 as a string: write 1.0e-3"
    )


def test_several_errors_stay_on_one_line():
    with pytest.raises(ConfigError) as info:
        parse_partition({"scheme": "dirichlet", "alpha": float("nan"), "min_size": True, "x\ny": 1})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("partition.alpha: must be a finite number (got nan); ")
    assert "partition.min_size: must be an integer (got True); " in message
    assert "partition.'x\\ny': unknown parameter" in message


def test_bool_parameter_is_strict():
    with pytest.raises(ConfigError, match=r"^partition\.drop_remainder: must be true or false \(got 1\)$"):
        parse_partition({"scheme": "apfl_mnist", "drop_remainder": 1})


def test_unhashable_or_odd_scheme_names_are_config_errors():
    for bad in (["dirichlet"], {"a": 1}, 3, None):
        with pytest.raises(ConfigError, match=r"^partition\.scheme: "):
            parse_partition({"scheme": bad})


def y_small(n=300, classes=10, seed=0):
    return rng(seed).integers(0, classes, n)


@pytest.mark.parametrize("alpha", [float("inf"), float("nan"), 1e308])
def test_dirichlet_degenerate_draws_terminate(alpha):
    # Bypassing validation as a caller could: NaN (inf, nan) or all-zero (1e308) draws used to give NaN or
    # negative counts, and the repair then never finished.
    scheme = Dirichlet.model_construct(alpha=alpha, min_size=5, max_retries=3)
    y = y_small()
    with time_limit():
        counts = scheme._one_pass(np.bincount(y), 20, rng())
        parts = scheme.split(y, 20, rng())
    assert counts.min() >= 0 and np.array_equal(counts.sum(0), np.bincount(y))
    assert_partition(parts, len(y), 20, covers=True)
    assert min(len(p) for p in parts) >= 5


@pytest.mark.parametrize(
    "counts, min_size",
    [
        (np.zeros((3, 2), dtype=np.int64), 1),  # fewer samples than clients * min_size
        (np.array([[5, -1], [0, 0]]), 1),  # negative counts, as a NaN draw used to produce
        (np.array([[2, 0], [0, 1], [0, 0]]), 2),
    ],
)
def test_dirichlet_repair_never_loops_forever(counts, min_size):
    with time_limit(), pytest.raises(ConfigError) as info:
        dirichlet_module._repair(counts.copy(), min_size)
    assert_config_error(info.value)


def test_dirichlet_repair_still_repairs():
    counts = np.array([[5, 0], [0, 0], [1, 3]])
    with time_limit():
        moved = dirichlet_module._repair(counts, 2)
    assert moved == 2 and counts.sum(1).min() >= 2 and counts.min() >= 0 and counts.sum() == 9


@pytest.mark.parametrize(
    "weights",
    [[np.inf, 1.0, np.inf], [1e308, 1e308, 1.0], [0.0, 0.0, 0.0], [np.nan, 1.0, 2.0], [5e-324, 0.0, 0.0]],
)
def test_largest_remainder_survives_overflowed_weights(weights):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        counts = largest_remainder(np.array(weights), 10, rng())
    assert counts.dtype == np.int64 and counts.min() >= 0 and counts.sum() == 10


@pytest.mark.parametrize(
    "params",
    [
        {"scheme": "quantity", "sigma": 1e4, "min_size": 1},
        {"scheme": "quantity", "distribution": "power_law", "exponent": 1e-4, "min_size": 1},
        {"scheme": "apfl_mnist", "users": 20, "first": 0, "sigma": 1e3},
        {"scheme": "apfl_mnist", "users": 20, "first": 0, "sigma": 1e3, "drop_remainder": False},
        {"scheme": "femnist_lognormal", "users": 20, "mean": 1e3},
        {"scheme": "femnist_lognormal", "users": 20, "mean": -1e3, "offset": 0.0, "min_per_class": 0},
    ],
)
def test_overflowing_samplers_still_give_valid_partitions(params):
    # Out of the accepted ranges (so built without validation): lognormal/Pareto draws overflow to inf or
    # underflow to 0. They used to turn into NaN shares and negative counts.
    scheme = SCHEMES[params["scheme"]].model_construct(**params)
    y = np.repeat(np.arange(5), 10)
    n = None if scheme.scheme != "quantity" else 5
    with time_limit(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        parts = scheme.split(y, n, rng())
    assert_partition(parts, len(y), scheme.num_clients(n), covers(scheme, y))


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("n", [None, 1, 3])
def test_empty_labels_are_a_config_error(name, n):
    # shards used to divide by the zero classes (ZeroDivisionError); natural returned one part for 0 clients.
    with time_limit(), pytest.raises(ConfigError) as info:
        parse_partition({"scheme": name}).split(np.zeros(0, dtype=np.int64), n, rng(), np.zeros(0))
    assert_config_error(info.value)


@pytest.mark.parametrize(
    "params, n",
    [
        ({"scheme": "dirichlet", "min_size": 1}, 3),
        ({"scheme": "shards", "shards_per_client": 1}, 3),
        ({"scheme": "label_k", "k": 1}, 3),
        ({"scheme": "apfl_mnist", "users": 4, "first": 0}, None),
        ({"scheme": "femnist_lognormal", "users": 4}, None),
    ],
)
def test_sparse_huge_label_values_need_no_huge_arrays(params, n):
    # Label values index per-class arrays: {0, 7} must not differ from {0, 1}, nor {0, 2**62} crash.
    y = np.array([0, 2**62, 7, 0, 2**62, 7, 7, 0, 2**62])
    dense = np.unique(y, return_inverse=True)[1].reshape(-1)
    scheme = parse_partition(params)
    with time_limit():
        parts = scheme.split(y, n, rng(3))
    assert_partition(parts, len(y), scheme.num_clients(n), covers(scheme, y))
    assert all(np.array_equal(a, b) for a, b in zip(parts, scheme.split(dense, n, rng(3))))


def test_huge_client_counts_are_config_errors_not_allocations():
    y = y_small()
    for params in ({"scheme": "shards"}, {"scheme": "label_k"}, {"scheme": "dirichlet"}, {"scheme": "iid"}):
        with time_limit(), pytest.raises(ConfigError) as info:
            parse_partition(params).split(y, 10**12, rng())
        assert_config_error(info.value)
    with pytest.raises(ConfigError, match=r"^n_clients: must be a positive integer \(got True\)$"):
        parse_partition({"scheme": "iid"}).split(y, True, rng())


def test_natural_rejects_empty_and_incomparable_groups():
    with pytest.raises(ConfigError, match=r"^groups: "):
        parse_partition({"scheme": "natural"}).split(np.zeros(0, dtype=int), None, rng(), np.zeros(0))
    with pytest.raises(ConfigError, match=r"^groups: "):
        groups = np.array([1, "a", None], dtype=object)
        parse_partition({"scheme": "natural"}).split(np.zeros(3, dtype=int), None, rng(), groups)
