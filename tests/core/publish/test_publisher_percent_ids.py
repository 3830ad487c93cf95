"""A producer id holding '%' (a URL-encoded run id, "100%") reaches the stored header as
given. The publisher's header lines are %-format templates; the id used to go into them
unescaped, so every publish raised TypeError ('run%20b'), or the header silently lost a
'%' ('a%%b' stored as 'a%b', which a resuming run would not recognise as its own)."""

from __future__ import annotations

import asyncio

import nats
import pytest

from airflow_nats_ordered.core.order.watermarks import GlobalOrder
from airflow_nats_ordered.core.publish.msg_ids import HDR_MSG_ID, HDR_PRODUCER, derive_msg_id
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.keys import HDR_KEY
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision


@pytest.mark.parametrize("producer_id", ["run%20b", "a%%b", "100%", "run%d", "%s%%d"])
@pytest.mark.parametrize("global_order", [False, True])
def test_a_producer_id_with_percent_signs_is_stored_as_given(
    nats_url, unique_name, producer_id, global_order
):
    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            async with OrderedPublisher(
                nc,
                unique_name,
                producer_id=producer_id,
                allow_keyless=True,
                **({"global_order": GlobalOrder()} if global_order else {}),  # no knob before it
            ) as pub:
                await pub.publish("k", b"x")
                await pub.publish(None, b"y")  # the keyless header template too
            js = nc.jetstream()
            stored = [dict((await js.get_msg(unique_name, s)).headers or {}) for s in (1, 2)]
            return sorted(stored, key=lambda h: HDR_KEY not in h)  # the keyed one first
        finally:
            await nc.close()

    keyed, keyless = asyncio.run(go())
    assert keyed[HDR_PRODUCER] == keyless[HDR_PRODUCER] == producer_id
    assert keyed[HDR_MSG_ID] == derive_msg_id(producer_id, 1, "k", b"x")
