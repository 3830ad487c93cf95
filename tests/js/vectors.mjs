// Recomputes every golden vector of docs/protocol.md (section 10) with protocol.mjs and
// prints {"checked": n, "mismatches": [...]} as JSON; exit code 1 when anything differs.
//   node vectors.mjs <path of docs/protocol.md>

import { readFileSync } from "node:fs";
import {
  headerBlock,
  keyBytes,
  keyHeader,
  messageKey,
  msgId,
  murmur3,
  partitionFor,
  partitionSubject,
} from "./protocol.mjs";

const page = readFileSync(process.argv[2], "utf-8");
const m = page.match(/<!-- golden-vectors[^>]*-->\s*```json\n([\s\S]*?)\n```/);
if (!m) throw new Error("no golden-vectors block in the page");
const v = JSON.parse(m[1]);
const te = new TextEncoder();
const mismatches = [];
let checked = 0;

function expect(what, got, want) {
  checked++;
  if (JSON.stringify(got) !== JSON.stringify(want)) mismatches.push({ what, got, want });
}

for (const r of v.records) {
  const label = JSON.stringify(r.key);
  let partition = r.partition; // a keyless record's partition is the producer's choice
  if (r.key !== null) {
    const kb = keyBytes(r.key);
    expect(`${label} key_utf8_hex`, Buffer.from(kb).toString("hex"), r.key_utf8_hex);
    expect(`${label} murmur3`, murmur3(kb), r.murmur3);
    partition = partitionFor(r.key, v.partitions);
    expect(`${label} partition`, partition, r.partition);
    const [name, value] = keyHeader(r.key);
    expect(`${label} key_header`, { name, value }, r.key_header);
    const back = messageKey((h) => (h === name ? value : undefined));
    expect(`${label} read back`, back, r.key);
  }
  expect(`${label} subject`, partitionSubject(v.prefix, partition), r.subject);
  const id = msgId(v.producer_id, r.index, r.key, te.encode(r.payload));
  expect(`${label} msg_id`, id, r.msg_id);
  expect(`${label} headers`, headerBlock(id, r.key, r.seq, v.producer_id), r.headers);
}
for (const pv of v.partition_vectors) {
  expect(`${JSON.stringify(pv.key)} murmur3`, murmur3(keyBytes(pv.key)), pv.murmur3);
  expect(`${JSON.stringify(pv.key)} mod ${pv.partitions}`, partitionFor(pv.key, pv.partitions), pv.partition);
}
console.log(JSON.stringify({ checked, mismatches }));
process.exit(mismatches.length ? 1 : 0);
