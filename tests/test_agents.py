"""Agent code as an environment (``plexctl.agents``): the training sequence made of an episode's
recorded turns, and the endpoint an unmodified ``openai`` SDK agent is given."""

from __future__ import annotations

from plexctl.agents import Turn, episode_of


def test_turns_that_extend_each_other_make_one_sequence_with_the_loss_on_sampled_tokens_only() -> None:
    first = Turn(prompt=[1, 2, 3], tokens=[10, 11], logprobs=[-0.1, -0.2], finish="stop")
    second = Turn(prompt=[1, 2, 3, 10, 11, 4, 5], tokens=[12], logprobs=[-0.3], finish="stop")
    ep = episode_of({"prompt": "p"}, [first, second])
    assert ep.token_ids == [1, 2, 3, 10, 11, 4, 5, 12]
    assert ep.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert ep.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3]
    assert (ep.turns, ep.prompt_tokens, ep.prefix_mismatches, ep.truncated) == (2, 3, 0, False)


def test_a_turn_that_rewrites_the_history_starts_the_sequence_again_and_is_counted() -> None:
    first = Turn(prompt=[1, 2], tokens=[10, 11], logprobs=[-0.1, -0.2], finish="stop")
    rewritten = Turn(prompt=[1, 2, 99, 4], tokens=[12, 13], logprobs=[-0.3, -0.4], finish="length")
    ep = episode_of({}, [first, rewritten])
    assert ep.token_ids == [1, 2, 99, 4, 12, 13] and ep.loss_mask == [0, 0, 0, 0, 1, 1]
    assert (ep.prefix_mismatches, ep.dropped_tokens, ep.truncated) == (1, 2, True)


def test_an_episode_with_no_turn_has_nothing_to_train() -> None:
    ep = episode_of({}, [])
    assert ep.token_ids == [] and not any(ep.loss_mask) and ep.turns == 0


def test_the_endpoint_records_an_sdk_agents_turns_under_its_key_and_refuses_other_keys(tiny_model) -> None:
    """An ``openai`` SDK agent given the endpoint's base_url and its episode's key: its request
    reaches the job's client as token ids (the chat's text, no template) and its completion is
    recorded as that episode's turn; a key of no episode is refused, and records nothing."""
    from types import SimpleNamespace

    import openai
    import pytest

    from plexctl.agents import AgentEndpoint
    from plexctl.common.calls import Completion

    asked = []

    class Client:
        def call_async(self, request):
            asked.append(request)
            return len(asked)

        def wait(self, call_id):
            request = asked[call_id - 1]
            return [
                Completion(i, "7", list(p), [22, 2], [-0.5, -0.25], "stop") for i, p in enumerate(request.prompt_tokens)
            ]

        def completions(self, reply):
            return reply

    job = SimpleNamespace(client=Client(), spec=SimpleNamespace(model=SimpleNamespace(path=str(tiny_model))), version=3)
    with AgentEndpoint(job) as endpoint:
        endpoint.turns["ep-1"] = []
        agent = openai.OpenAI(base_url=endpoint.base_url, api_key="ep-1", max_retries=0)
        reply = agent.chat.completions.create(model="anything", messages=[{"role": "user", "content": "3+4="}])
        assert reply.choices[0].message.content == "7"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=endpoint.base_url, api_key="ep-2", max_retries=0).models.list()
    [turn] = endpoint.turns["ep-1"]
    from transformers import AutoTokenizer

    assert turn.prompt == AutoTokenizer.from_pretrained(str(tiny_model))("3+4=")["input_ids"]
    assert (turn.tokens, turn.logprobs) == ([22, 2], [-0.5, -0.25]) and len(asked) == 1
