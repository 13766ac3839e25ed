#!/usr/bin/env python3
# Writes the GGUF seed corpus into tests/data/gguf/corpus: small valid files ("valid-*", which must parse) and
# crafted broken ones ("bad-*", which must be refused with an error): truncations at every header field and
# inside the data, huge counts and lengths, bad value and tensor types, bad dims, overflowing shapes, bad
# alignment, misplaced or overlapping data, duplicates. Standard library only: python3 make_corpus.py
# Inputs that the fuzzer finds are added beside these by hand (crash-*), not by this script.
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "gguf", "corpus")

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
PACK = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B", U64: "<Q", I64: "<q",
        F64: "<d"}
# ggml type id -> (block elems, block bytes)
GGML = {0: (1, 4), 1: (1, 2), 8: (32, 34), 12: (256, 144), 26: (1, 4), 28: (1, 8), 30: (1, 2)}


# Encoders return lists of pieces, one per field, so that File can mark where each field starts.
def s(b):
    b = b.encode() if isinstance(b, str) else b
    return [struct.pack("<Q", len(b)), b]


def val(t, v):
    if t == STR:
        return s(v)
    if t == ARR:
        et, items = v
        return [struct.pack("<I", et), struct.pack("<Q", len(items))] + [p for x in items for p in val(et, x)]
    return [struct.pack(PACK[t], v)]


def kv(key, t, v):
    return s(key) + [struct.pack("<I", t)] + val(t, v)


def raw(*parts):
    return [p for part in parts for p in (part if isinstance(part, list) else [part])]


def nbytes(dims, t):
    """Data bytes of a tensor, or 0 when the shape is invalid or too big to lay out here."""
    if t not in GGML or not dims or any(d <= 0 for d in dims):
        return 0
    be, bb = GGML[t]
    n = dims[0] // be * bb
    for d in dims[1:]:
        n *= d
    return n if n <= 1 << 24 else 0


class File:
    """A GGUF file built field by field; `marks` records the offset where each field starts."""

    def __init__(self, kvs, tensors, version=3, alignment=32, magic=b"GGUF", n_kv=None, n_tensors=None):
        self.marks = []
        b = bytearray()

        def put(x):
            self.marks.append(len(b))
            b.extend(x)

        put(magic)
        put(struct.pack("<I", version))
        put(struct.pack("<Q", len(tensors) if n_tensors is None else n_tensors))
        put(struct.pack("<Q", len(kvs) if n_kv is None else n_kv))
        for k in kvs:
            for piece in k:
                put(piece)
        offset = 0
        placed = []
        for name, dims, t, off in tensors:
            if off is None:
                off = offset
            size = nbytes(dims, t)
            offset = max(offset, (off + size + alignment - 1) // alignment * alignment) if off < 1 << 24 else offset
            for piece in s(name):
                put(piece)
            put(struct.pack("<I", len(dims)))
            for d in dims:
                put(struct.pack("<Q", d & (2**64 - 1)))
            put(struct.pack("<I", t))
            put(struct.pack("<Q", off))
            placed.append((off, size))
        data_start = (len(b) + alignment - 1) // alignment * alignment
        b.extend(b"\0" * (data_start - len(b)))
        self.marks.append(data_start)
        data = bytearray(offset)
        for i, (off, size) in enumerate(placed):
            for j in range(min(size, 64)):
                if off + j < len(data):
                    data[off + j] = (i * 37 + j) & 0xFF
            if size:
                self.marks.append(data_start + off + size - 1)  # cut inside the last byte of each tensor
        b.extend(data)
        self.data_end = data_start + max((off + size for off, size in placed), default=0)
        self.bytes = bytes(b)


BASE_KVS = [
    kv("general.architecture", STR, "deepseek4"),
    kv("t.u8", U8, 200), kv("t.i8", I8, -100), kv("t.u16", U16, 60000), kv("t.i16", I16, -30000),
    kv("t.u32", U32, 4000000000), kv("t.i32", I32, -2000000000), kv("t.f32", F32, 1.5), kv("t.bool", BOOL, 1),
    kv("t.u64", U64, 2**63 + 5), kv("t.i64", I64, -(2**62)), kv("t.f64", F64, 0.25),
    kv("t.ratios", ARR, (I32, [0, 4, 128])),
    kv("t.tokens", ARR, (STR, ["a", "bc", b"\xff\xfe not utf-8", ""])),
    kv("t.nested", ARR, (ARR, [(I32, [1, 2]), (STR, ["x"]), (ARR, [(U8, [7])])])),
    kv("t.f32s", ARR, (F32, [10.0, 0.5])),
    kv("t.empty", ARR, (U64, [])),
]
BASE_TENSORS = [
    ("token_embd.weight", [8, 4], 1, None),
    ("blk.0.attn_q_a.weight", [64, 2], 8, None),
    ("blk.0.attn_norm.weight", [8], 0, None),
    ("blk.0.ffn_gate_tid2eid.weight", [2, 3], 26, None),
]


def nested(depth):
    v = (U8, [1])
    for _ in range(depth - 1):
        v = (ARR, [v])
    return v


def main():
    os.makedirs(OUT, exist_ok=True)
    for f in os.listdir(OUT):
        if f.startswith(("valid-", "bad-")):
            os.remove(os.path.join(OUT, f))
    files = {}

    base = File(BASE_KVS, BASE_TENSORS)
    files["valid-basic"] = base.bytes
    files["valid-v2"] = File(BASE_KVS, BASE_TENSORS, version=2).bytes
    files["valid-align64"] = File(BASE_KVS + [kv("general.alignment", U32, 64)], BASE_TENSORS, alignment=64).bytes
    files["valid-empty"] = File([], []).bytes
    files["valid-metadata-only"] = File(BASE_KVS, []).bytes
    files["valid-nest-8"] = File([kv("deep", ARR, nested(8))], []).bytes
    files["valid-4d-q4k"] = File([], [("experts", [256, 2, 2, 2], 12, None)]).bytes

    # Truncated at every field boundary and inside every tensor's data.
    for cut in sorted(set(m for m in base.marks if 0 < m < base.data_end)):
        files[f"bad-trunc-{cut:05d}"] = base.bytes[:cut]
    files["bad-trunc-0"] = b""
    files["bad-trunc-mid-magic"] = b"GG"

    # Header.
    files["bad-magic"] = b"GGUX" + base.bytes[4:]
    files["bad-magic-ggml"] = b"lmgg" + base.bytes[4:]
    for v in (0, 1, 4, 0x03000000):
        files[f"bad-version-{v}"] = File(BASE_KVS, BASE_TENSORS, version=v).bytes
    files["bad-kv-count-huge"] = File(BASE_KVS, BASE_TENSORS, n_kv=2**63).bytes
    files["bad-kv-count-more"] = File(BASE_KVS, BASE_TENSORS, n_kv=len(BASE_KVS) + 1).bytes
    files["bad-tensor-count-huge"] = File(BASE_KVS, BASE_TENSORS, n_tensors=2**64 - 1).bytes
    files["bad-tensor-count-more"] = File(BASE_KVS, BASE_TENSORS, n_tensors=len(BASE_TENSORS) + 1).bytes

    # Metadata.
    files["bad-key-len-huge"] = File([[struct.pack("<Q", 2**64 - 1), b"abc"]], []).bytes
    files["bad-key-empty"] = File([kv("", U32, 1)], []).bytes
    files["bad-string-len-huge"] = File([raw(s("k"), struct.pack("<IQ", STR, 2**63), b"xy")], []).bytes
    files["bad-value-type-13"] = File([raw(s("k"), struct.pack("<I", 13), b"\0" * 8)], []).bytes
    files["bad-value-type-huge"] = File([raw(s("k"), struct.pack("<I", 0xFFFFFFFF), b"\0" * 8)], []).bytes
    files["bad-array-elem-type"] = File([raw(s("k"), struct.pack("<IIQ", ARR, 99, 1), b"\0" * 8)], []).bytes
    files["bad-array-count-huge"] = File([raw(s("k"), struct.pack("<IIQ", ARR, U64, 2**62))], []).bytes
    files["bad-array-count-strings"] = File([raw(s("k"), struct.pack("<IIQ", ARR, STR, 10**12), s("a"))], []).bytes
    files["bad-array-count-nested"] = File([raw(s("k"), struct.pack("<IIQ", ARR, ARR, 2**40))], []).bytes
    files["bad-array-count-u8-past-end"] = File([raw(s("k"), struct.pack("<IIQ", ARR, U8, 1000), b"\1" * 10)], []).bytes
    files["bad-nest-9"] = File([kv("deep", ARR, nested(9))], []).bytes
    files["bad-nest-100"] = File([raw(s("deep"), struct.pack("<I", ARR), struct.pack("<IQ", ARR, 1) * 100)], []).bytes
    files["bad-bool-2"] = File([kv("b", BOOL, 2)], []).bytes
    files["bad-bool-in-array"] = File([kv("b", ARR, (BOOL, [0, 1, 255]))], []).bytes
    files["bad-duplicate-key"] = File(BASE_KVS + [kv("t.u8", U8, 1)], BASE_TENSORS).bytes
    files["bad-alignment-type"] = File([kv("general.alignment", I32, 64)], BASE_TENSORS).bytes
    files["bad-alignment-u64"] = File([kv("general.alignment", U64, 64)], BASE_TENSORS).bytes
    files["bad-alignment-zero"] = File([kv("general.alignment", U32, 0)], BASE_TENSORS).bytes
    files["bad-alignment-3"] = File([kv("general.alignment", U32, 3)], BASE_TENSORS, alignment=3).bytes
    files["bad-alignment-huge"] = File([kv("general.alignment", U32, 2**31)], BASE_TENSORS).bytes

    # Tensor infos.
    def one(dims, t=0, off=None, name="w"):
        return File([], [(name, dims, t, off)]).bytes

    files["bad-name-empty"] = one([4], name="")
    files["bad-ndims-0"] = one([])
    files["bad-ndims-5"] = one([32, 1, 1, 1, 1])
    files["bad-dim-0"] = one([4, 0])
    files["bad-dim-negative"] = one([4, -1])
    files["bad-dim-huge"] = one([2**63])
    files["bad-dims-overflow"] = one([2**32, 2**32])
    files["bad-dims-overflow-4d"] = one([2**16, 2**16, 2**16, 2**16])
    files["bad-bytes-overflow"] = one([2**31, 2**31], t=28)
    files["bad-type-retired-4"] = one([32], t=4)
    files["bad-type-40"] = one([32], t=40)
    files["bad-type-huge"] = one([32], t=0xFFFFFFFF)
    files["bad-q8-ne0-33"] = one([33, 2], t=8)
    files["bad-q4k-ne0-32"] = one([32], t=12)
    files["bad-offset-unaligned"] = one([8], off=4)
    past = one([8], off=4096)
    files["bad-data-past-end"] = past[: len(past) - 4096]
    files["bad-size-past-end"] = File([], [("w", [8], 0, None), ("big", [1 << 20], 0, None)]).bytes[:300]
    files["bad-offset-overflow"] = one([8], off=2**64 - 32)
    files["bad-overlap"] = File([], [("a", [16], 0, 0), ("b", [8], 0, 32)]).bytes
    files["bad-overlap-same"] = File([], [("a", [8], 0, 0), ("b", [8], 0, 0)]).bytes
    files["bad-duplicate-tensor"] = File([], [("a", [8], 0, None), ("a", [8], 0, None)]).bytes

    for name, data in sorted(files.items()):
        with open(os.path.join(OUT, name + ".gguf"), "wb") as fh:
            fh.write(data)
    print(len(files), "files in", os.path.normpath(OUT))


main()
