"""The shared block index's key layout in Redis (or Valkey), written by `prefix-sidecar
kv-indexer` (writer.py) and read by sidecars (lookup.py).

- `{ns}:b:<16 hex digits>`: a HASH per block, named by our chained key (block_keys.py); a
  field per pod and tier holding it, `<pod URL>@<medium>`, its value the pod's generation.
- `{ns}:block_sizes`: a HASH, pod URL -> the block size its events report.
- `{ns}:pods`: a HASH, pod URL -> its generation, a random 63-bit number drawn whenever what
  the index held of the pod stops being true (restart, lost events, indexer start). A block
  field whose value is not its pod's generation is void: one HSET voids a pod's whole past,
  cleaned up lazily. A lookup is one round trip (LONGEST_MATCH_LUA); it names the block keys
  inside the script, undeclared, so the index lives on one primary (and its replicas), not
  on a Redis Cluster.
"""

from __future__ import annotations

import secrets

from prefix_sidecar.kv_events.block_keys import KEY_BYTES, key_bytes

DEFAULT_NAMESPACE = "prefix-sidecar"
DEFAULT_MEDIUM = "gpu"
MAX_LOOKUP_BLOCKS = 256
# vLLM's media are few (GPU, CPU, DISK): a longer one is not a tier name.
MAX_MEDIUM_CHARS = 16


def block_name(namespace: str, key: int) -> str:
    return f"{block_prefix(namespace)}{key.to_bytes(KEY_BYTES, 'little').hex()}"


def block_prefix(namespace: str) -> str:
    return f"{namespace}:b:"


def pods_name(namespace: str) -> str:
    return f"{namespace}:pods"


def block_sizes_name(namespace: str) -> str:
    return f"{namespace}:block_sizes"


def field(pod: str, medium: str | None) -> str:
    tier = (medium or DEFAULT_MEDIUM).lower()[:MAX_MEDIUM_CHARS]
    return f"{pod}@{tier}"


def pod_of(field_name: str) -> str:
    return field_name.rpartition("@")[0]


def new_generation() -> str:
    return str(secrets.randbits(63))


def sampled(keys: list[int], limit: int = MAX_LOOKUP_BLOCKS) -> list[tuple[int, int]]:
    """(block count up to and with it, key) of at most `limit` keys of a chain, evenly
    spaced, the last always in: a pod holds a chain's blocks from the first on (vLLM evicts
    a chain's tail first), so the last sampled block it holds bounds its match."""
    if len(keys) <= limit:
        return [(index + 1, key) for index, key in enumerate(keys)]
    step = len(keys) / limit
    picks = sorted({min(len(keys) - 1, int((n + 1) * step) - 1) for n in range(limit)})
    return [(index + 1, keys[index]) for index in picks]


def lookup_args(namespace: str, keys: list[int], most_fields: int) -> list[str]:
    """LONGEST_MATCH_LUA's ARGV for `keys`, a chain: its blocks' name prefix, the sampled
    keys' hex run together (one argument: redis-py encodes each in Python, ~2 us apiece),
    their block counts (empty when each is its position), the most fields a block may have."""
    if len(keys) <= MAX_LOOKUP_BLOCKS:  # every key, each its position: no pairs to make
        return [block_prefix(namespace), key_bytes(keys).hex(), "", str(most_fields)]
    picks = sampled(keys)
    counts = " ".join(str(count) for count, _ in picks)
    hexes = key_bytes([key for _, key in picks]).hex()
    return [block_prefix(namespace), hexes, counts, str(most_fields)]


# Run in Redis (EVALSHA), so a lookup is one command with a reply as small as the pods that
# match, whatever the chain's length: KEYS[1] the pods hash; ARGV as lookup_args makes them.
# It stops at the first block no matching pod holds. It writes nothing (no-writes: it may
# run on a read replica, and while Redis is out of memory).
LONGEST_MATCH_LUA = """#!lua flags=no-writes
local generation = {}
local pods = redis.call('HGETALL', KEYS[1])
for i = 1, #pods, 2 do generation[pods[i]] = pods[i + 1] end
local prefix, hexes, most = ARGV[1], ARGV[2], tonumber(ARGV[4]) * 2
local counts = {}
for count in string.gmatch(ARGV[3], '%d+') do counts[#counts + 1] = count end
local width = 2 * KEY_BYTES
local alive, matched = nil, {}
for k = 1, math.floor(#hexes / width) do
  local name = prefix .. string.sub(hexes, (k - 1) * width + 1, k * width)
  local fields = redis.call('HGETALL', name)
  local count = counts[k] or tostring(k)
  local holding, any = {}, false
  if #fields <= most then
    for i = 1, #fields, 2 do
      local pod = string.match(fields[i], '^(.*)@[^@]*$')
      if pod and generation[pod] == fields[i + 1] and (alive == nil or alive[pod]) then
        holding[pod], matched[pod], any = true, count, true
      end
    end
  end
  if not any then break end
  alive = holding
end
local out = {}
for pod, count in pairs(matched) do
  out[#out + 1] = pod
  out[#out + 1] = count
end
return out
""".replace("KEY_BYTES", str(KEY_BYTES))
