"""What the reading mixins of :class:`~.reader.GlobalOrderReader` (the window modes'
:class:`~.window_reader.WindowReading`, the exact event-time mode's
:class:`~.producer_reader.ProducerReading`) call on the reader: declared once here,
implemented by ``GlobalOrderReader``."""

from __future__ import annotations

from typing import Any


class ReaderHooks:
    """The reader's own steps a reading mode hands its records to."""

    def _fail(self, exc: BaseException) -> None:
        raise NotImplementedError

    async def _apply(self, msg: Any, where: str, why: str = "") -> bool:
        raise NotImplementedError

    async def _handled(self, p: int, seq: int) -> None:
        raise NotImplementedError

    async def _commit_if_due(self) -> None:
        raise NotImplementedError

    def _message(self, p: int, t: int, item: Any, late: bool) -> Any:
        raise NotImplementedError
