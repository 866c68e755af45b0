"""The upstream side: one SDK generation per choice, run together, their chunks merged in arrival order.

Leaving the iterator early (the HTTP client went away, or an error) cancels every call still
running, which cancels the gRPC calls and frees the verifier's slots.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from dspark_client import AsyncClient, Chunk, DSparkError, FinishReason

from .errors import ApiError, from_upstream
from .openai_request import ChoiceRequest

_DONE = object()


async def merged_chunks(client: AsyncClient, choices: Sequence[ChoiceRequest],
                        metadata: Sequence[tuple[str, str]] = ()) -> AsyncIterator[tuple[int, Chunk]]:
    """Yields (choice index, chunk) as they come; raises ApiError on the first failure."""
    queue: asyncio.Queue = asyncio.Queue()

    async def run(choice: ChoiceRequest) -> None:
        try:
            async for item in client.generate_stream(metadata=metadata, **choice.params):
                await queue.put((choice.index, item))
            await queue.put((choice.index, _DONE))
        except DSparkError as error:
            await queue.put((choice.index, from_upstream(error.code, str(error))))
        except Exception as error:  # noqa: BLE001  (reported to the HTTP client, never crashes the server)
            await queue.put((choice.index, ApiError(500, f"upstream call failed: {error}", type="server_error")))

    tasks = [asyncio.create_task(run(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, ApiError):
                raise item
            else:
                if item.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED):
                    raise ApiError(503 if item.finish_reason == FinishReason.CANCELLED else 500,
                                   f"generation {item.finish_reason.value}: {item.error or 'no detail'}",
                                   type="server_error")
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
