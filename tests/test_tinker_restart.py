"""A Tinker client outlives ``plexctl down`` / ``up`` (``--tinker-port 0`` takes the port it took
before, so the client's base_url still holds): its next call waits for the cluster and goes
on from the run's last saved state; what was lost is said (the front end's log, the job's events,
and an ``optim_step`` whose ``forward_backward`` calls were lost is refused, saying so)."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest
from conftest import Cluster

tinker = pytest.importorskip("tinker")

from test_tinker_e2e import supervised_data  # noqa: E402


def test_a_training_client_goes_on_from_its_saved_state_after_down_and_up(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    cluster = Cluster(tmp_path, env={"TINKER_TELEMETRY": "0"}).up(tiny_model, "--tinker-port", "0")
    try:
        url = json.loads((cluster.state_dir / "tinker.json").read_text())["url"]
        key = (cluster.home / "tinker-api-key").read_text().strip()
        service = tinker.ServiceClient(base_url=url, api_key=key)
        training = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=7).result()
        tokenizer = training.get_tokenizer()
        data = supervised_data(tokenizer, 8)
        adam = tinker.AdamParams(learning_rate=1e-2)
        for _ in range(2):
            training.forward_backward(data, "cross_entropy").result()
            training.optim_step(adam).result()
        saved = training.save_state("two").result().path
        at_save = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
        sampler_path = training.save_weights_for_sampler("two").result().path
        sampler = service.create_sampling_client(model_path=sampler_path).result()
        prompt = tinker.ModelInput.from_ints(tokenizer("3+4=")["input_ids"])
        greedy = tinker.SamplingParams(max_tokens=3, temperature=0.0)
        before = sampler.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(adam).result()  # step 3: after the last save, lost in the restart
        after_step3 = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
        training.forward_backward(data, "cross_entropy").result()  # not stepped: lost too

        assert cluster.run("down", timeout=300).returncode == 0
        cluster.up(tiny_model, "--tinker-port", "0")  # the same command: the port it took the first time
        assert json.loads((cluster.state_dir / "tinker.json").read_text())["url"] == url

        # the same client objects go on; the trainer's state went with the cluster: the first
        # call fails, naming the saved state and step the run went back to
        told = rf"lost its trainer state.*{re.escape(saved)}, step 2: 1 optim_step\(s\) since then.*send them again"
        with pytest.raises(tinker.RequestFailedError, match=told):
            training.forward(data, "cross_entropy").result()
        again = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
        assert again == pytest.approx(at_save, rel=1e-6) and again != pytest.approx(after_step3, rel=1e-6)
        with pytest.raises(tinker.RequestFailedError, match=told):
            training.optim_step(adam).result()  # its forward_backward was lost: said, not stepped on nothing
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(adam).result()  # step 3 again, from the saved state: the same as before
        redone = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
        assert redone == pytest.approx(after_step3, rel=1e-5)
        same = sampler.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
        assert same.tokens == before.tokens  # saved sampler weights outlive the restart, unchanged
        anew = service.create_sampling_client(model_path=sampler_path).result()
        assert anew.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0].tokens == before.tokens

        job = next(j for j in cluster.status()["jobs"] if j["name"].startswith("tinker-"))
        assert job["state"] == "running" and job["restarts"] == 1 and job["step"] == 3
        with sqlite3.connect(cluster.state_dir / "journal.db") as db:
            rows = db.execute("SELECT detail FROM events WHERE kind='note' AND job_id=?", (job["job_id"],))
            notes = [detail for (detail,) in rows]
        assert len(notes) == 1 and saved in notes[0] and "step 2" in notes[0], notes
        assert saved in (cluster.state_dir / "tinker.log").read_text()
    finally:
        cluster.run("down", timeout=120)
