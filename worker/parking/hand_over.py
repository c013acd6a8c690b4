"""Handing a URL's message on: parsed or rejected, then produced, or ended in ``crawl_errors``.

The scheduler's parks, the wait line and the halted line all hand messages on this way
(SPEC.md §1): a message that is no crawl request goes to ``rejected_messages``; a URL whose
message Kafka refuses (too large once its wait fields are added) ends as ``MessageRefused``.
"""
from __future__ import annotations

from typing import Any

from common.contracts import (CRAWL_ERRORS_TOPIC, REJECTED_TOPIC, CrawlRequest, InvalidMessage,
                              crawl_error_message, crawl_request, parse_crawl_request, rejected_message)
from common.protocols import MessageProducer
from common.statuses import Status
from worker import metrics
from worker.intake.feed import Record
from worker.outcomes.task import deliver


async def reject(producer: MessageProducer, record: Record, error: str) -> None:
    """``record`` to ``rejected_messages`` with ``error``."""
    message = rejected_message(record.topic, record.value, error)
    await deliver(producer, REJECTED_TOPIC, message, from_topic=record.topic, offset=record.offset)
    metrics.outcome(metrics.REJECTED)


async def parse_or_reject(producer: MessageProducer, record: Record, message: Any = None) -> CrawlRequest | None:
    """The request ``record`` holds, or None once it is rejected. ``message``: its value's JSON if
    the caller decoded it already (``wait_topics.decoded``); None: decoded here."""
    try:
        return parse_crawl_request(record.value) if message is None else crawl_request(message)
    except InvalidMessage as exc:
        await reject(producer, record, str(exc))
        return None


async def hand_on(producer: MessageProducer, request: CrawlRequest, topic: str, value: bytes,
                  partition: int | None = None) -> None:
    """``value`` to ``topic`` (keyed by the source, or to ``partition``); refused, the URL ends."""
    if not await deliver(producer, topic, value, request.source, partition, identifier=request.uuid):
        error = crawl_error_message(request, Status.MESSAGE_REFUSED, None)
        await deliver(producer, CRAWL_ERRORS_TOPIC, error, identifier=request.uuid)
