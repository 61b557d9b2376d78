"""The worker's engine options as pure functions: what a GPU node gets, what a CPU node gets,
and one clear line for what cannot work (no torch, no GPU needed)."""

from __future__ import annotations

import pytest

from worker.engine_options import OptionError, engine_options, resolve_device, resolve_dtype, visible_device_ids


def test_a_gpu_worker_trains_and_samples_in_bf16_on_its_gpu() -> None:
    opts = engine_options("auto", "auto", None, cuda_available=True, visible_devices="3")
    assert (opts.device, opts.dtype) == ("cuda", "bfloat16")
    assert opts.micro_batch_tokens > 0


def test_a_cpu_worker_stays_in_fp32_as_before() -> None:
    opts = engine_options("auto", "auto", None, cuda_available=False, visible_devices=None)
    assert (opts.device, opts.dtype) == ("cpu", "float32")


def test_an_asked_dtype_and_budget_win_over_the_defaults() -> None:
    opts = engine_options("cpu", "bfloat16", 4096, cuda_available=True, visible_devices="0")
    assert (opts.device, opts.dtype, opts.micro_batch_tokens) == ("cpu", "bfloat16", 4096)


def test_cuda_asked_where_there_is_none_names_the_option_and_what_was_seen() -> None:
    with pytest.raises(OptionError, match=r"--device cuda: .*CUDA_VISIBLE_DEVICES=''"):
        resolve_device("cuda", cuda_available=False, visible_devices="")
    with pytest.raises(OptionError, match="no GPU"):
        resolve_device("cuda", cuda_available=False, visible_devices=None)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: resolve_device("tpu", True, None), "--device 'tpu'"),
        (lambda: resolve_dtype("fp8", "cuda"), "--dtype 'fp8'"),
        (lambda: engine_options("auto", "auto", 0, False, None), "--micro-batch-tokens 0"),
    ],
)
def test_bad_options_are_one_line_each(call, match) -> None:
    with pytest.raises(OptionError, match=match) as err:
        call()
    assert "\n" not in str(err.value)


def test_visible_devices_are_the_ids_slurm_gave() -> None:
    assert visible_device_ids("2,3") == ["2", "3"]
    assert visible_device_ids("") == [] and visible_device_ids(None) == []


def test_a_trainer_sharing_its_gpu_is_capped_to_its_share_on_cuda_only(monkeypatch) -> None:
    import torch

    from worker.main import cap_memory

    calls: list[float] = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, *a: calls.append(f))
    cap_memory(0.4, "cuda")
    cap_memory(0.4, "cpu")
    cap_memory(None, "cuda")
    assert calls == [0.4]


def test_packed_rows_get_flash_attentions_varlen_kernel_only_on_a_gpu_in_bf16_or_fp16_where_it_imports() -> None:
    from worker.engine_options import trainer_attention

    assert trainer_attention("cuda", "bfloat16", True, flash_attn=True) == "flash_attention_2"
    assert trainer_attention("cuda", "float16", True, flash_attn=True) == "flash_attention_2"
    assert trainer_attention("cuda", "float32", True, flash_attn=True) is None  # flash-attn takes no fp32
    assert trainer_attention("cuda", "bfloat16", True, flash_attn=False) is None  # not installed: SDPA
    assert trainer_attention("cuda", "bfloat16", False, flash_attn=True) is None  # padded rows: as before
    assert trainer_attention("cpu", "bfloat16", True, flash_attn=True) is None
