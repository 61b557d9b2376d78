"""For Tinker SDK users: a full fine-tuning training client, which the SDK's ``ServiceClient`` has
no method for.

The SDK's ``CreateModelRequest`` takes ``lora_config=None``; a PlexRL cluster reads that as a run
that trains every weight of the base (a job without a ``lora`` section). ``full_training_client``
sends that request on the service client's own session, the way ``create_lora_training_client``
sends its LoRA one, and returns the SDK's own ``TrainingClient``: every call after it is the
unmodified SDK's. It uses the SDK's internal client holder, so it is pinned with the SDK (0.38.0).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinker import ServiceClient, TrainingClient


def full_training_client(
    service: ServiceClient, base_model: str, user_metadata: dict[str, str] | None = None
) -> TrainingClient:
    """A training client that trains every weight of ``base_model`` (AdamW, as the SDK's default)."""
    from tinker import types
    from tinker.lib.api_future_impl import _APIFuture
    from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
    from tinker.lib.public_interfaces.training_client import TrainingClient, fetch_training_info
    from tinker.lib.queue_state_logger import QueueStateLogger

    holder = service.holder
    session_id, model_seq_id = holder.get_session_id(), holder.get_training_client_id()

    async def create() -> TrainingClient:
        start = time.time()
        with holder.aclient(ClientConnectionPoolType.TRAIN) as client:
            request = types.CreateModelRequest(
                session_id=session_id,
                model_seq_id=model_seq_id,
                base_model=base_model,
                lora_config=None,
                user_metadata=user_metadata,
                optimizer_config=types.AdamOptimizerConfig(),
            )
            future = await client.models.create(request=request)
        created = await _APIFuture(
            types.CreateModelResponse,
            holder,
            future,
            request_start_time=start,
            request_type="CreateModel",
            queue_state_observer=QueueStateLogger(base_model, "Model creation"),
        ).result_async()
        info = await fetch_training_info(holder, created.model_id)
        return TrainingClient(holder, model_seq_id=model_seq_id, model_id=created.model_id, info=info)

    return holder.run_coroutine_threadsafe(create()).result()
