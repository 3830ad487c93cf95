// A foreign producer taking part in an event-time global order (docs/protocol.md section
// 12.1): every record carries its event time in a header, as integer Unix epoch
// milliseconds (what Date.now() gives), on the partition its key routes to.
//   node event_time_producer.mjs <nats url> <stream> <producer id> <records.json>
// records.json: {"header": string, "records": [{"key": string, "payload": string,
// "time": integer ms}]}. Prints {"published", "partitions": {key: partition}}.

import { readFileSync } from "node:fs";
import { connect, headers } from "@nats-io/transport-node";
import { jetstream, jetstreamManager } from "@nats-io/jetstream";
import {
  HDR_PRODUCER,
  keyHeader,
  partitionFor,
  partitionSubject,
  streamContract,
} from "./protocol.mjs";

const [url, streamName, producerId, file] = process.argv.slice(2);
const { header, records } = JSON.parse(readFileSync(file, "utf-8"));

const nc = await connect({ servers: url });
const js = jetstream(nc);
const stream = streamContract(await (await jetstreamManager(nc)).streams.info(streamName));
const te = new TextEncoder();
const out = { published: 0, partitions: {} };

// one at a time, in input order (stop-and-wait): the records' stored order is the file's
for (const r of records) {
  const p = partitionFor(r.key, stream.partitions);
  const h = headers();
  const [name, value] = keyHeader(r.key);
  h.set(name, value);
  h.set(HDR_PRODUCER, producerId);
  h.set(header, String(r.time));
  await js.publish(partitionSubject(stream.prefix, p), te.encode(r.payload), { headers: h });
  out.partitions[r.key] = p;
  out.published++;
}

await nc.drain();
console.log(JSON.stringify(out));
