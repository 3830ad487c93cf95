// A foreign producer written from docs/protocol.md: publishes records to a nats-ordered
// stream, in order per partition (section 7.2 method A: stop-and-wait per partition,
// partitions in parallel, every resend with the same msg-id).
//   node producer.mjs <nats url> <stream> <producer id> <records.json>
// records.json: {"records": [{"key": string|null, "payload": string, "b64": bool?}]}
// ("b64": carry a header-safe key in the encoded form anyway, which section 4.2 allows).
// Prints {"published", "duplicates", "resends", "marks": {partition: stream seq}}.

import { readFileSync } from "node:fs";
import { connect, headers } from "@nats-io/transport-node";
import { jetstream, jetstreamManager } from "@nats-io/jetstream";
import {
  HDR_KEY_B64,
  HDR_PRODUCER,
  HDR_SEQ,
  keyBytes,
  keyHeader,
  msgId,
  partitionFor,
  partitionSubject,
  streamContract,
} from "./protocol.mjs";

const [url, streamName, producerId, file] = process.argv.slice(2);
const { records } = JSON.parse(readFileSync(file, "utf-8"));
const ACK_TIMEOUT_MS = 5000;
const GIVE_UP_S = 60; // the longest a record is resent after its first send

const nc = await connect({ servers: url });
const js = jetstream(nc);
const stream = streamContract(await (await jetstreamManager(nc)).streams.info(streamName));
if (stream.duplicateWindowSeconds < GIVE_UP_S + ACK_TIMEOUT_MS / 1000) {
  throw new Error(`stream ${streamName}'s duplicate_window is shorter than our resends`);
}

// route and number every record in input order (section 5.3: seq is the position among
// this producer's records of the partition; section 6: the msg-id is of the record's place
// in the input, not of its partition); keyless records go round-robin
const lanes = new Map();
let rr = 0;
const te = new TextEncoder();
for (const [i, r] of records.entries()) {
  const p = r.key === null ? rr++ % stream.partitions : partitionFor(r.key, stream.partitions);
  if (!lanes.has(p)) lanes.set(p, []);
  const lane = lanes.get(p);
  const seq = lane.length + 1;
  const payload = te.encode(r.payload);
  const h = headers();
  if (r.key !== null) {
    const [name, value] = r.b64
      ? [HDR_KEY_B64, Buffer.from(keyBytes(r.key)).toString("base64")]
      : keyHeader(r.key);
    h.set(name, value);
  }
  h.set(HDR_SEQ, String(seq));
  h.set(HDR_PRODUCER, producerId);
  lane.push({ payload, h, id: msgId(producerId, i + 1, r.key, payload) });
}

const out = { published: 0, duplicates: 0, resends: 0, marks: {} };

async function sendLane(p, lane) {
  const subject = partitionSubject(stream.prefix, p);
  for (const rec of lane) {
    const first = Date.now();
    for (;;) {
      try {
        const ack = await js.publish(subject, rec.payload, {
          msgID: rec.id,
          headers: rec.h,
          timeout: ACK_TIMEOUT_MS,
        });
        if (ack.duplicate) out.duplicates++;
        out.marks[p] = Math.max(out.marks[p] || 0, ack.seq);
        out.published++;
        break;
      } catch (err) {
        // in doubt: resend the same record (same msg-id) before anything later
        if ((Date.now() - first) / 1000 > GIVE_UP_S) throw err;
        out.resends++;
        await new Promise((r) => setTimeout(r, 200));
      }
    }
  }
}

await Promise.all([...lanes].map(([p, lane]) => sendLane(p, lane)));
await nc.drain();
console.log(JSON.stringify(out));
