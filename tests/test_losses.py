"""The loss registry is the one table of losses: the spec, the wire, the trainer's checks and its
dispatch all follow an entry, and a new entry is a loss everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from plexctl.common import losses as L
from plexctl.common.calls import LOSSES, TOKEN_LOSSES, LossCall, TokenDatum, TrainHParams
from plexctl.common.spec import SpecError, read_spec
from worker.errors import BatchError
from worker.tinker_losses import LossInputs, check_call, loss_function, token_loss
from worker.train_batches import check_hparams

pytestmark = pytest.mark.unit


def test_the_call_types_name_exactly_the_registrys_losses_of_each_kind() -> None:
    assert set(LOSSES) | set(TOKEN_LOSSES) == set(L.LOSS_REGISTRY)
    assert not set(LOSSES) & set(TOKEN_LOSSES)
    assert TrainHParams().loss == L.DEFAULT_RL_LOSS in LOSSES


@pytest.mark.parametrize("name", list(L.LOSS_REGISTRY))
def test_every_entrys_function_is_the_workers_and_takes_its_settings(name: str) -> None:
    entry = L.LOSS_REGISTRY[name]
    assert callable(loss_function(name))
    settings = entry.settings({key: 0.5 for key, default in entry.config.items() if default is None})
    assert list(settings) == list(entry.config)
    if entry.kind == "token":
        assert entry.required()[0] == "target_tokens" and "weights" not in entry.required()


def datum(**fields: Any) -> TokenDatum:
    good: dict[str, Any] = dict(
        tokens=[1, 2, 3], target_tokens=[2, 3, 4], weights=[1.0] * 3, logprobs=[-1.0] * 3, advantages=[1.0] * 3
    )
    return TokenDatum(**{**good, **fields})


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ({"beta": -1.0}, "beta must be >= 0, got -1"),
        ({"beta": float("nan")}, "beta must be finite, got nan"),
        ({}, "beta has no default; give one"),
    ],
)
def test_the_workers_check_of_a_token_loss_is_the_registrys(config: dict[str, float], problem: str) -> None:
    with pytest.raises(BatchError, match=f"^loss_fn dro: loss_fn_config {problem}$"):
        check_call(LossCall([datum()], "dro", config))


def test_an_rl_losss_parameters_are_checked_by_the_registry_in_the_trainer_and_the_spec() -> None:
    with pytest.raises(BatchError, match=r"^loss pg-tis: loss_params cap must be > 0, got 0$"):
        check_hparams(TrainHParams(loss="pg-tis", loss_params={"cap": 0.0}))
    with pytest.raises(BatchError, match="loss pg-clip takes no parameters; got loss_params cap"):
        check_hparams(TrainHParams(loss="pg-clip", loss_params={"cap": 2.0}))
    check_hparams(TrainHParams(loss="pg-tis", loss_params={"cap": 3.0}))
    with pytest.raises(SpecError) as e:
        read_spec(CONFIG, ["algo.loss=pg-tis", "algo.loss_params={cap: 0}"])
    assert "algo.loss_params.cap" in str(e.value) and "must be > 0, got 0" in str(e.value)


CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-arith.yaml"


def test_the_specs_loss_choices_are_the_registrys() -> None:
    with pytest.raises(SpecError) as e:
        read_spec(CONFIG, ["algo.loss=ppo"])
    assert "algo.loss" in str(e.value)
    for name in L.loss_names("rl"):
        assert name in str(e.value)


def test_a_new_token_loss_is_one_entry_and_one_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry added to the registry is accepted by the worker's check and computed by the function
    it names, with its settings' defaults and bounds, with no other table to update."""
    entry = L.Loss("token", "tests.test_losses:scaled_ce", "scale * cross entropy", ("weights",), {"scale": 2.0})
    monkeypatch.setitem(L.LOSS_REGISTRY, "scaled_ce", entry)
    loss_function.cache_clear()
    call = LossCall([datum()], "scaled_ce", {})
    check_call(call)
    tlp = torch.tensor([-1.0, -2.0, -3.0])
    got = token_loss("scaled_ce", {}, tlp, LossInputs.of(call.data[0]))
    assert got.item() == pytest.approx(12.0)
    with pytest.raises(BatchError, match="loss_fn scaled_ce takes scale; got loss_fn_config beta"):
        check_call(LossCall([datum()], "scaled_ce", {"beta": 1.0}))
    loss_function.cache_clear()


def scaled_ce(tlp: torch.Tensor, inputs: LossInputs, settings: dict[str, float]) -> torch.Tensor:
    assert inputs.weights is not None
    return -(tlp * inputs.weights).sum() * settings["scale"]


def test_the_registry_is_plain_data_the_cli_can_import_without_torch() -> None:
    assert msgspec.json.encode({n: e.function for n, e in L.LOSS_REGISTRY.items()})
    assert all(":" in e.function and e.function.startswith("worker.") for e in L.LOSS_REGISTRY.values())
