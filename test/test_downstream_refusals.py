"""What our own servers refuse about one message or value (issue 29), on the real servers:
a refusal of one thing is told apart from an outage, so it ends one URL instead of stalling it."""
from __future__ import annotations

import asyncio

import pytest
from confluent_kafka import KafkaError
from redis.exceptions import (BusyLoadingError, ConnectionError as RedisConnectionError, DataError,
                              OutOfMemoryError, ReadOnlyError, ResponseError)

from common.kafka import AsyncProducer, DeliveryFailed, MessageRefused, producer_config, refuses_the_message
from common.redis_client import refuses_the_value


async def test_a_message_too_large_is_refused_and_the_next_one_goes(kafka_hosts: str, unique: str) -> None:
    producer = AsyncProducer(producer_config(kafka_hosts))
    try:
        with pytest.raises(MessageRefused, match="MSG_SIZE_TOO_LARGE"):
            await asyncio.wait_for(producer.send(f"refusals-{unique}", b"x" * 2_000_000), 10)
        await asyncio.wait_for(producer.send(f"refusals-{unique}", b"small"), 30)
    finally:
        await producer.close(5)


def test_only_errors_about_the_message_count_as_its_refusal() -> None:
    for code in (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_RECORD, KafkaError.RECORD_LIST_TOO_LARGE):
        assert refuses_the_message(KafkaError(code))
    for code in (KafkaError._MSG_TIMED_OUT, KafkaError._TRANSPORT, KafkaError.NOT_LEADER_FOR_PARTITION,
                 KafkaError.TOPIC_AUTHORIZATION_FAILED):
        assert not refuses_the_message(KafkaError(code))
    assert not refuses_the_message("broker said no") and not refuses_the_message(None)
    assert not isinstance(DeliveryFailed("x"), MessageRefused)


async def test_redis_errors_about_a_value_are_told_from_errors_about_the_server(redis_client) -> None:
    await redis_client.set("refusals:text", "not a number")
    await redis_client.rpush("refusals:list", "a")
    for call in (lambda: redis_client.incr("refusals:text"), lambda: redis_client.get("refusals:list"),
                 lambda: redis_client.eval("return redis.call('DECR', KEYS[1])", 1, "refusals:text")):
        with pytest.raises(ResponseError) as error:
            await call()
        assert refuses_the_value(error.value), error.value
    with pytest.raises(DataError) as data_error:
        await redis_client.set("refusals:none", None)
    assert refuses_the_value(data_error.value)
    for outage in (OutOfMemoryError("OOM command not allowed"), ReadOnlyError("READONLY replica"),
                   ResponseError("MISCONF Redis is configured to save RDB snapshots"),
                   ResponseError("BUSY Redis is busy running a script"), BusyLoadingError("LOADING"),
                   RedisConnectionError("Connection refused"), ResponseError("MASTERDOWN Link is down")):
        assert not refuses_the_value(outage), outage
