// The nats-ordered wire protocol, format 1, implemented from docs/protocol.md alone
// (section numbers below are the page's). No code of the Python package was read for it.

import { blake2b } from "@noble/hashes/blake2b";

const te = new TextEncoder();
const utf8 = new TextDecoder("utf-8", { fatal: true });

export const HDR_KEY = "Nats-Ordered-Key";
export const HDR_KEY_B64 = "Nats-Ordered-Key-B64";
export const HDR_MSG_ID = "Nats-Msg-Id";
export const HDR_SEQ = "Nats-Ordered-Seq";
export const HDR_PRODUCER = "Nats-Ordered-Producer";
export const MAX_KEY_BYTES = 4096;
export const FORMAT = "1";

/** Section 4.1: the key bytes (UTF-8, exact); refuses what a producer must not send. */
export function keyBytes(key) {
  if (!key.isWellFormed()) throw new Error(`key ${JSON.stringify(key)} has a lone surrogate`);
  const kb = te.encode(key);
  if (kb.length === 0) throw new Error("an empty key means keyless: send no key header");
  if (kb.length > MAX_KEY_BYTES) {
    throw new Error(`key is ${kb.length} bytes in UTF-8; at most ${MAX_KEY_BYTES}`);
  }
  return kb;
}

function rotl(x, r) {
  return ((x << r) | (x >>> (32 - r))) >>> 0;
}

/** Section 4.4: MurmurHash3 x86_32 of bytes, unsigned. */
export function murmur3(bytes, seed = 0) {
  const c1 = 0xcc9e2d51;
  const c2 = 0x1b873593;
  let h = seed >>> 0;
  const blocks = bytes.length >>> 2;
  for (let i = 0; i < blocks; i++) {
    const o = i * 4;
    let k = bytes[o] | (bytes[o + 1] << 8) | (bytes[o + 2] << 16) | (bytes[o + 3] << 24);
    k = Math.imul(k, c1);
    k = rotl(k, 15);
    k = Math.imul(k, c2);
    h ^= k;
    h = rotl(h, 13);
    h = (Math.imul(h, 5) + 0xe6546b64) >>> 0;
  }
  const tail = bytes.length & 3;
  if (tail) {
    const o = blocks * 4;
    let k = 0;
    if (tail === 3) k ^= bytes[o + 2] << 16;
    if (tail >= 2) k ^= bytes[o + 1] << 8;
    k ^= bytes[o];
    k = Math.imul(k, c1);
    k = rotl(k, 15);
    k = Math.imul(k, c2);
    h ^= k;
  }
  h ^= bytes.length;
  h ^= h >>> 16;
  h = Math.imul(h, 0x85ebca6b);
  h ^= h >>> 13;
  h = Math.imul(h, 0xc2b2ae35);
  h ^= h >>> 16;
  return h >>> 0;
}

/** Section 4.4: the partition of a key among P. */
export function partitionFor(key, partitions) {
  return murmur3(keyBytes(key)) % partitions;
}

/** Section 3: the subject of a partition. */
export function partitionSubject(prefix, partition) {
  return `${prefix}.p.${partition}`;
}

/** Section 4.2: printable ASCII only, no blank at either end. */
export function isHeaderSafe(key) {
  if (key.length === 0 || key[0] === " " || key[key.length - 1] === " ") return false;
  for (let i = 0; i < key.length; i++) {
    const c = key.charCodeAt(i);
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

/** Section 4.2: the one header carrying a key: [name, value]. */
export function keyHeader(key) {
  const kb = keyBytes(key);
  if (isHeaderSafe(key)) return [HDR_KEY, key];
  return [HDR_KEY_B64, Buffer.from(kb).toString("base64")];
}

/** Section 4.2, reader rules: the key, null for keyless; throws for a malformed key.
 * `get(name)` returns the header's value or undefined. */
export function messageKey(get) {
  const encoded = get(HDR_KEY_B64);
  if (encoded !== undefined) {
    if (get(HDR_KEY) !== undefined) throw new Error("malformed key: both key headers are set");
    const raw = Buffer.from(encoded, "base64");
    if (raw.toString("base64") !== encoded) {
      throw new Error(`malformed key: ${HDR_KEY_B64} is not canonical base64`);
    }
    if (raw.length === 0) throw new Error(`malformed key: ${HDR_KEY_B64} is empty`);
    return utf8.decode(raw); // throws on invalid UTF-8
  }
  const plain = get(HDR_KEY);
  return plain ? plain : null;
}

/** Section 6: the derived msg-id. `index`: the record's 1-based place in the run's input
 * (not its partition or position there); `key` null for a keyless record; `payload` bytes. */
export function msgId(producerId, index, key, payload) {
  const kb = key === null ? new Uint8Array(0) : keyBytes(key);
  const parts = [
    te.encode(producerId),
    Uint8Array.of(0),
    te.encode(String(index)),
    Uint8Array.of(0),
    kb,
    Uint8Array.of(0),
    payload,
  ];
  const pre = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let o = 0;
  for (const p of parts) {
    pre.set(p, o);
    o += p.length;
  }
  return Buffer.from(blake2b(pre, { dkLen: 15 })).toString("hex");
}

/** Section 5.3: the header block the Python publisher sends (for the golden vectors). */
export function headerBlock(id, key, seq, producerId) {
  const lines = ["NATS/1.0", `${HDR_MSG_ID}: ${id}`];
  if (key !== null) {
    const [name, value] = keyHeader(key);
    lines.push(`${name}: ${value}`);
  }
  lines.push(`${HDR_SEQ}: ${seq}`, `${HDR_PRODUCER}: ${producerId}`);
  return lines.join("\r\n") + "\r\n\r\n";
}

/** Section 2.1: P, prefix and the checks, from a stream's info. */
export function streamContract(info) {
  const name = info.config.name;
  const meta = info.config.metadata || {};
  const p = meta["nats-ordered.partitions"];
  if (p === undefined) throw new Error(`stream ${name} is not a partitioned stream`);
  if (!/^[0-9]+$/.test(p)) throw new Error(`stream ${name}: partitions ${p} is not an integer`);
  if (meta["nats-ordered.hash"] !== "murmur3_x86_32" || meta["nats-ordered.seed"] !== "0") {
    throw new Error(`stream ${name} uses another hash: keys would land on other partitions`);
  }
  if (meta["nats-ordered.format"] !== FORMAT) {
    throw new Error(`stream ${name} has format ${meta["nats-ordered.format"]}; this knows ${FORMAT}`);
  }
  const partitions = Number(p);
  if (partitions < 1 || partitions > 4096) throw new Error(`stream ${name}: bad P ${p}`);
  return {
    name,
    partitions,
    prefix: meta["nats-ordered.prefix"],
    duplicateWindowSeconds: (info.config.duplicate_window || 0) / 1e9,
  };
}
