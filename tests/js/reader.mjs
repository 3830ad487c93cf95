// A foreign reader written from docs/protocol.md: reads every record of a nats-ordered
// stream in stream order and decodes its key (section 4.2), checking it belongs to the
// partition it is stored on (section 8).
//   node reader.mjs <nats url> <stream>
// Prints one JSON object per record: {"seq", "subject", "partition", "key", "payload",
// "routed", "msg_id", "producer_seq"} ("key": null for keyless, "error" for a malformed key).

import { connect } from "@nats-io/transport-node";
import { jetstreamManager } from "@nats-io/jetstream";
import { HDR_MSG_ID, HDR_SEQ, messageKey, partitionFor, streamContract } from "./protocol.mjs";

const [url, streamName] = process.argv.slice(2);
const nc = await connect({ servers: url });
const jsm = await jetstreamManager(nc);
const info = await jsm.streams.info(streamName);
const stream = streamContract(info);
const head = `${stream.prefix}.p.`;
const td = new TextDecoder();

for (let seq = info.state.first_seq; seq <= info.state.last_seq; seq++) {
  const m = await jsm.streams.getMessage(streamName, { seq });
  if (!m) continue;
  const get = (name) => (m.header && m.header.has(name) ? m.header.get(name) : undefined);
  const tail = m.subject.slice(head.length);
  const partition = m.subject.startsWith(head) && /^(0|[1-9][0-9]*)$/.test(tail) ? Number(tail) : null;
  const rec = {
    seq,
    subject: m.subject,
    partition,
    payload: td.decode(m.data),
    msg_id: get(HDR_MSG_ID) ?? null,
    producer_seq: get(HDR_SEQ) ?? null,
  };
  try {
    rec.key = messageKey(get);
    rec.routed = rec.key === null || partitionFor(rec.key, stream.partitions) === partition;
  } catch (err) {
    rec.key = null;
    rec.error = String(err.message || err);
  }
  console.log(JSON.stringify(rec));
}
await nc.close();
