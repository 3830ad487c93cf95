"""docs/protocol.md section 12 (global order): the watermark and position examples on the
page (section 12.1: the event-time mode's position; 12.2: a global producer's mark and the
exact event-time mode's position) have exactly the fields, in the order, that the
publisher, the producer and the reader write."""

from __future__ import annotations

import asyncio
import json
import re

import nats
from protocol_page import page_text

from airflow_nats_ordered.core.group.global_position import POSITION_KEY
from airflow_nats_ordered.core.order.event_time import DEFAULT_TIME_HEADER
from airflow_nats_ordered.core.order.producer import GlobalProducer
from airflow_nats_ordered.core.order.reader import GlobalOrderReader
from airflow_nats_ordered.core.order.watermarks import GlobalOrder
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.buckets import watermark_bucket
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision


def _section_12_examples() -> list[dict]:
    text = page_text()
    section = text[text.index("## 12. Global order") :]
    return [json.loads(b) for b in re.findall(r"```json\n(.*?)\n```", section, re.S)]


def test_the_pages_watermark_and_position_examples_are_what_the_code_writes(nats_url, unique_name):
    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()) as pub:
                await pub.publish("a", b"1")
            reader = GlobalOrderReader(nc, unique_name, "g", lambda m: None, commit_every=1)
            await reader.start()
            js = nc.jetstream()
            state = await js.key_value(f"nor_{unique_name}_g_state")
            while reader.stats.commits < 1:
                await asyncio.sleep(0.02)
            await reader.stop()
            wm = await js.key_value(watermark_bucket(unique_name))
            return (
                json.loads((await wm.get("w.0")).value),
                json.loads((await state.get(POSITION_KEY)).value),
            )
        finally:
            await nc.close()

    watermark, position = asyncio.run(asyncio.wait_for(go(), 60))
    page_watermark, page_position = _section_12_examples()[:2]
    assert list(watermark) == list(page_watermark)
    assert list(position) == list(page_position)
    for page, real in ((page_watermark, watermark), (page_position, position)):
        for field, value in page.items():
            numbers = isinstance(value, int | float) and isinstance(real[field], int | float)
            assert numbers or isinstance(real[field], type(value)), field
    assert position["g"] == 1 and watermark["g"] == 2


def test_the_pages_event_time_position_example_is_what_the_reader_writes(nats_url, unique_name):
    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            async with OrderedPublisher(nc, unique_name) as pub:
                await pub.publish("a", b"1", headers={DEFAULT_TIME_HEADER: "1795637069123"})
            got: list = []
            reader = GlobalOrderReader(
                nc, unique_name, "g", got.append, order_by="event-time", lateness=0.1
            )
            await reader.start()
            async with asyncio.timeout(60):
                while not got or reader.stats.commits < 1:
                    await asyncio.sleep(0.02)
            await reader.stop()
            state = await nc.jetstream().key_value(f"nor_{unique_name}_g_state")
            return json.loads((await state.get(POSITION_KEY)).value), got[0]
        finally:
            await nc.close()

    position, msg = asyncio.run(go())
    page = _section_12_examples()[2]
    assert list(position) == list(page)
    for field, value in page.items():
        assert isinstance(position[field], type(value)), field
    assert position["g"] == msg.global_seq == 1795637069123 * 1_000_000
    assert position["order"] == "event-time" and position["tie"] == msg.stream_seq


def test_the_pages_producer_mark_and_exact_position_examples_are_what_the_code_writes(
    nats_url, unique_name
):
    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            async with GlobalProducer(OrderedPublisher(nc, unique_name), "billing") as prod:
                await prod.publish("a", b"1", event_time=1795637069123)
                await prod.watermark()
                mark = json.loads((await prod._kv.get("p.billing")).value)
            got: list = []
            reader = GlobalOrderReader(
                nc, unique_name, "g", got.append, order_by="event-time", watermarks=True
            )
            await reader.start()
            async with asyncio.timeout(60):
                while not got or reader.stats.commits < 1:
                    await asyncio.sleep(0.02)
            await reader.stop()
            state = await nc.jetstream().key_value(f"nor_{unique_name}_g_state")
            return mark, json.loads((await state.get(POSITION_KEY)).value), got[0]
        finally:
            await nc.close()

    mark, position, msg = asyncio.run(go())
    page_mark, page_position = _section_12_examples()[3:5]
    for page, real in ((page_mark, mark), (page_position, position)):
        assert list(real) == list(page)
        for field, value in page.items():
            numbers = isinstance(value, int | float) and isinstance(real[field], int | float)
            assert numbers or isinstance(real[field], type(value)), field
    assert mark["e"] == msg.global_seq == position["g"] == 1795637069123 * 1_000_000
    assert mark["state"] == "open" and mark["n"] == 1 and position["pkey"] == ["billing", 1, 1]
    assert position["order"] == "event-time-exact"
