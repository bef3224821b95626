"""HPACK (RFC 7541) header-block decoding for the daemon's own HTTP/2 gRPC server.

Only the decoding side: the server answers with literal fields that are never indexed and never
Huffman-coded, so it needs no encoder state. A decoder belongs to one connection and is not shared
between threads. Every malformed block raises one ``HpackError`` (the connection then ends with a
COMPRESSION_ERROR); no other exception escapes for any input bytes.

Huffman strings are decoded with a byte-at-a-time state machine: the states are the inner nodes of
the code tree, and each state's row (256 transitions, one per input byte) is built the first time the
state is entered, so import stays cheap and the common rows are ready after the first few requests.
"""

from __future__ import annotations

from typing import Final

__all__ = ["STATIC_TABLE", "HpackDecoder", "HpackError", "encode_integer", "encode_literal", "huffman_decode"]


class HpackError(Exception):
    """A header block that cannot be decoded (a COMPRESSION_ERROR for the connection)."""


# RFC 7541 Appendix A; index 1 is the first entry.
STATIC_TABLE: Final[tuple[tuple[bytes, bytes], ...]] = (
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
)
_STATIC_COUNT: Final = len(STATIC_TABLE)
# Indexed by the wire index itself (slot 0 is never returned: index 0 is refused before the lookup).
_STATIC_BY_INDEX: Final[tuple[tuple[bytes, bytes], ...]] = ((b"", b""), *STATIC_TABLE)

ENTRY_OVERHEAD: Final = 32  # RFC 7541 section 4.1: an entry's size is name + value + 32 octets

# An integer may take at most this many continuation octets and must stay below the bound: every
# legitimate value (an index, a string length, a table size) is far smaller.
_MAX_INT_CONTINUATIONS: Final = 5
_MAX_INT: Final = 2**32 - 1

# Huffman codes of RFC 7541 Appendix B as (code, length in bits), symbols 0..255 and EOS (256), five to a
# line, each line labelled with the symbol it starts at.
# fmt: off
_HUFFMAN_CODES: Final[tuple[tuple[int, int], ...]] = (
    (0x1ff8, 13), (0x7fffd8, 23), (0xfffffe2, 28), (0xfffffe3, 28), (0xfffffe4, 28),  # 0
    (0xfffffe5, 28), (0xfffffe6, 28), (0xfffffe7, 28), (0xfffffe8, 28), (0xffffea, 24),  # 5
    (0x3ffffffc, 30), (0xfffffe9, 28), (0xfffffea, 28), (0x3ffffffd, 30), (0xfffffeb, 28),  # 10
    (0xfffffec, 28), (0xfffffed, 28), (0xfffffee, 28), (0xfffffef, 28), (0xffffff0, 28),  # 15
    (0xffffff1, 28), (0xffffff2, 28), (0x3ffffffe, 30), (0xffffff3, 28), (0xffffff4, 28),  # 20
    (0xffffff5, 28), (0xffffff6, 28), (0xffffff7, 28), (0xffffff8, 28), (0xffffff9, 28),  # 25
    (0xffffffa, 28), (0xffffffb, 28), (0x14, 6), (0x3f8, 10), (0x3f9, 10),  # 30
    (0xffa, 12), (0x1ff9, 13), (0x15, 6), (0xf8, 8), (0x7fa, 11),  # 35
    (0x3fa, 10), (0x3fb, 10), (0xf9, 8), (0x7fb, 11), (0xfa, 8),  # 40
    (0x16, 6), (0x17, 6), (0x18, 6), (0x0, 5), (0x1, 5),  # 45
    (0x2, 5), (0x19, 6), (0x1a, 6), (0x1b, 6), (0x1c, 6),  # 50
    (0x1d, 6), (0x1e, 6), (0x1f, 6), (0x5c, 7), (0xfb, 8),  # 55
    (0x7ffc, 15), (0x20, 6), (0xffb, 12), (0x3fc, 10), (0x1ffa, 13),  # 60
    (0x21, 6), (0x5d, 7), (0x5e, 7), (0x5f, 7), (0x60, 7),  # 65
    (0x61, 7), (0x62, 7), (0x63, 7), (0x64, 7), (0x65, 7),  # 70
    (0x66, 7), (0x67, 7), (0x68, 7), (0x69, 7), (0x6a, 7),  # 75
    (0x6b, 7), (0x6c, 7), (0x6d, 7), (0x6e, 7), (0x6f, 7),  # 80
    (0x70, 7), (0x71, 7), (0x72, 7), (0xfc, 8), (0x73, 7),  # 85
    (0xfd, 8), (0x1ffb, 13), (0x7fff0, 19), (0x1ffc, 13), (0x3ffc, 14),  # 90
    (0x22, 6), (0x7ffd, 15), (0x3, 5), (0x23, 6), (0x4, 5),  # 95
    (0x24, 6), (0x5, 5), (0x25, 6), (0x26, 6), (0x27, 6),  # 100
    (0x6, 5), (0x74, 7), (0x75, 7), (0x28, 6), (0x29, 6),  # 105
    (0x2a, 6), (0x7, 5), (0x2b, 6), (0x76, 7), (0x2c, 6),  # 110
    (0x8, 5), (0x9, 5), (0x2d, 6), (0x77, 7), (0x78, 7),  # 115
    (0x79, 7), (0x7a, 7), (0x7b, 7), (0x7ffe, 15), (0x7fc, 11),  # 120
    (0x3ffd, 14), (0x1ffd, 13), (0xffffffc, 28), (0xfffe6, 20), (0x3fffd2, 22),  # 125
    (0xfffe7, 20), (0xfffe8, 20), (0x3fffd3, 22), (0x3fffd4, 22), (0x3fffd5, 22),  # 130
    (0x7fffd9, 23), (0x3fffd6, 22), (0x7fffda, 23), (0x7fffdb, 23), (0x7fffdc, 23),  # 135
    (0x7fffdd, 23), (0x7fffde, 23), (0xffffeb, 24), (0x7fffdf, 23), (0xffffec, 24),  # 140
    (0xffffed, 24), (0x3fffd7, 22), (0x7fffe0, 23), (0xffffee, 24), (0x7fffe1, 23),  # 145
    (0x7fffe2, 23), (0x7fffe3, 23), (0x7fffe4, 23), (0x1fffdc, 21), (0x3fffd8, 22),  # 150
    (0x7fffe5, 23), (0x3fffd9, 22), (0x7fffe6, 23), (0x7fffe7, 23), (0xffffef, 24),  # 155
    (0x3fffda, 22), (0x1fffdd, 21), (0xfffe9, 20), (0x3fffdb, 22), (0x3fffdc, 22),  # 160
    (0x7fffe8, 23), (0x7fffe9, 23), (0x1fffde, 21), (0x7fffea, 23), (0x3fffdd, 22),  # 165
    (0x3fffde, 22), (0xfffff0, 24), (0x1fffdf, 21), (0x3fffdf, 22), (0x7fffeb, 23),  # 170
    (0x7fffec, 23), (0x1fffe0, 21), (0x1fffe1, 21), (0x3fffe0, 22), (0x1fffe2, 21),  # 175
    (0x7fffed, 23), (0x3fffe1, 22), (0x7fffee, 23), (0x7fffef, 23), (0xfffea, 20),  # 180
    (0x3fffe2, 22), (0x3fffe3, 22), (0x3fffe4, 22), (0x7ffff0, 23), (0x3fffe5, 22),  # 185
    (0x3fffe6, 22), (0x7ffff1, 23), (0x3ffffe0, 26), (0x3ffffe1, 26), (0xfffeb, 20),  # 190
    (0x7fff1, 19), (0x3fffe7, 22), (0x7ffff2, 23), (0x3fffe8, 22), (0x1ffffec, 25),  # 195
    (0x3ffffe2, 26), (0x3ffffe3, 26), (0x3ffffe4, 26), (0x7ffffde, 27), (0x7ffffdf, 27),  # 200
    (0x3ffffe5, 26), (0xfffff1, 24), (0x1ffffed, 25), (0x7fff2, 19), (0x1fffe3, 21),  # 205
    (0x3ffffe6, 26), (0x7ffffe0, 27), (0x7ffffe1, 27), (0x3ffffe7, 26), (0x7ffffe2, 27),  # 210
    (0xfffff2, 24), (0x1fffe4, 21), (0x1fffe5, 21), (0x3ffffe8, 26), (0x3ffffe9, 26),  # 215
    (0xffffffd, 28), (0x7ffffe3, 27), (0x7ffffe4, 27), (0x7ffffe5, 27), (0xfffec, 20),  # 220
    (0xfffff3, 24), (0xfffed, 20), (0x1fffe6, 21), (0x3fffe9, 22), (0x1fffe7, 21),  # 225
    (0x1fffe8, 21), (0x7ffff3, 23), (0x3fffea, 22), (0x3fffeb, 22), (0x1ffffee, 25),  # 230
    (0x1ffffef, 25), (0xfffff4, 24), (0xfffff5, 24), (0x3ffffea, 26), (0x7ffff4, 23),  # 235
    (0x3ffffeb, 26), (0x7ffffe6, 27), (0x3ffffec, 26), (0x3ffffed, 26), (0x7ffffe7, 27),  # 240
    (0x7ffffe8, 27), (0x7ffffe9, 27), (0x7ffffea, 27), (0x7ffffeb, 27), (0xffffffe, 28),  # 245
    (0x7ffffec, 27), (0x7ffffed, 27), (0x7ffffee, 27), (0x7ffffef, 27), (0x7fffff0, 27),  # 250
    (0x3ffffee, 26), (0x3fffffff, 30),  # 255
)
# fmt: on
_EOS: Final = 256
_MAX_PADDING_BITS: Final = 7


def _build_tree() -> tuple[tuple[int, int], ...]:
    """The code tree as (child for bit 0, child for bit 1) per inner node, node 0 the root: a child
    >= 0 is an inner node, a child < 0 is the leaf of symbol ``~child``."""
    kids: list[list[int | None]] = [[None, None]]
    for symbol, (code, length) in enumerate(_HUFFMAN_CODES):
        node = 0
        for shift in range(length - 1, 0, -1):
            bit = (code >> shift) & 1
            child = kids[node][bit]
            if child is None:
                child = len(kids)
                kids.append([None, None])
                kids[node][bit] = child
            elif child < 0:
                raise AssertionError(f"Huffman code of symbol {symbol} extends another code")
            node = child
        if kids[node][code & 1] is not None:
            raise AssertionError(f"Huffman code of symbol {symbol} is a prefix of another code")
        kids[node][code & 1] = ~symbol
    tree: list[tuple[int, int]] = []
    for zero, one in kids:
        if zero is None or one is None:
            raise AssertionError("the Huffman code is not complete")
        tree.append((zero, one))
    return tuple(tree)


_TREE: Final = _build_tree()


def _ones_path() -> dict[int, int]:
    """Inner node -> depth, for the nodes reached from the root by 1-bits only (the padding path)."""
    depths = {0: 0}
    node, depth = 0, 0
    while True:
        node = _TREE[node][1]
        depth += 1
        if node < 0:
            return depths
        depths[node] = depth


_PADDING_DEPTH: Final = _ones_path()

# The transition of a state on one input byte: (next state, the symbols completed on the way), or None
# when the byte completes EOS. Rows are built on first use (see the module docstring).
_Row = list[tuple[int, bytes] | None]
_ROWS: Final[list[_Row | None]] = [None] * len(_TREE)
_SINGLE: Final = tuple(bytes((i,)) for i in range(256))


def _build_row(state: int) -> _Row:
    tree = _TREE
    row: _Row = []
    for byte in range(256):
        node = state
        first = -1
        emitted = b""
        for shift in range(7, -1, -1):
            child = tree[node][(byte >> shift) & 1]
            if child >= 0:
                node = child
                continue
            symbol = ~child
            if symbol == _EOS:
                row.append(None)
                break
            # Codes are at least 5 bits long, so one byte completes at most two symbols.
            if first < 0:
                first = symbol
                emitted = _SINGLE[symbol]
            else:
                emitted = bytes((first, symbol))
            node = 0
        else:
            row.append((node, emitted))
    _ROWS[state] = row
    return row


def huffman_decode(data: bytes) -> bytes:
    """Decode one Huffman-coded string literal (RFC 7541 section 5.2)."""
    rows = _ROWS
    state = 0
    parts: list[bytes] = []
    for byte in data:
        row = rows[state]
        if row is None:
            row = _build_row(state)
        step = row[byte]
        if step is None:
            raise HpackError("Huffman string contains the EOS symbol")
        state, emitted = step
        if emitted:
            parts.append(emitted)
    padding = _PADDING_DEPTH.get(state)
    if padding is None:
        raise HpackError("Huffman string ends inside a symbol (padding is not all ones)")
    if padding > _MAX_PADDING_BITS:
        raise HpackError(f"Huffman string has {padding} bits of padding (at most 7 allowed)")
    return b"".join(parts)


def _integer(block: bytes, pos: int, value: int) -> tuple[int, int]:
    """Finish an integer whose prefix was all ones (``value`` is the prefix maximum) from the
    continuation octets at ``pos``; return the value and the position after it."""
    end = len(block)
    shift = 0
    for _ in range(_MAX_INT_CONTINUATIONS):
        if pos >= end:
            raise HpackError("header block ends inside an integer")
        octet = block[pos]
        pos += 1
        value += (octet & 0x7F) << shift
        if not octet & 0x80:
            if value > _MAX_INT:
                raise HpackError(f"integer {value} is too large (limit {_MAX_INT})")
            return value, pos
        shift += 7
    raise HpackError(f"integer takes more than {_MAX_INT_CONTINUATIONS} continuation octets")


_HUFFMAN_CACHE_ENTRIES: Final = 256
_HUFFMAN_CACHE_MAX_OCTETS: Final = 256


class HpackDecoder:
    """The decoding context of one HTTP/2 connection: the dynamic table and the limits advertised in
    SETTINGS (``max_table_size`` is SETTINGS_HEADER_TABLE_SIZE, which is also the table's initial
    size; ``max_header_list_size`` bounds the decoded list, each field counted as name + value + 32)."""

    __slots__ = ("_cache", "_dynamic", "_limit", "_max_header_list_size", "_max_table_size", "_size")

    def __init__(self, max_table_size: int = 4096, max_header_list_size: int = 16384) -> None:
        if max_table_size < 0 or max_header_list_size < 0:
            raise ValueError("HPACK limits must not be negative")
        self._max_table_size = max_table_size
        self._max_header_list_size = max_header_list_size
        self._limit = max_table_size  # the size the encoder chose, at most max_table_size
        self._size = 0
        self._dynamic: list[tuple[bytes, bytes]] = []  # oldest first; index 62 is the last
        self._cache: dict[bytes, bytes] = {}  # Huffman-coded string -> decoded string

    @property
    def dynamic_table(self) -> tuple[tuple[bytes, bytes], ...]:
        """The dynamic table's entries, newest (index 62) first."""
        return tuple(reversed(self._dynamic))

    @property
    def dynamic_table_size(self) -> int:
        """The dynamic table's size in octets (RFC 7541 section 4.1)."""
        return self._size

    @property
    def dynamic_table_limit(self) -> int:
        """The dynamic table's current maximum size, as last set by the encoder."""
        return self._limit

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """Decode one complete header block (HEADERS + CONTINUATION payloads joined, padding/priority
        already stripped)."""
        if type(block) is not bytes:
            block = bytes(block)  # slices must be hashable bytes (the Huffman cache keys on them)
        headers: list[tuple[bytes, bytes]] = []
        static = _STATIC_BY_INDEX
        list_size = 0
        list_limit = self._max_header_list_size
        end = len(block)
        pos = 0
        while pos < end:
            octet = block[pos]
            pos += 1
            if octet & 0x80:  # indexed field (section 6.1)
                index = octet & 0x7F
                if index == 0x7F:
                    index, pos = _integer(block, pos, index)
                field = static[index] if 0 < index <= _STATIC_COUNT else self._lookup(index)
            elif octet & 0x40:  # literal with incremental indexing (section 6.2.1)
                field, pos = self._literal(block, pos, octet & 0x3F, 0x3F)
                self._insert(field)
            elif octet & 0x20:  # dynamic table size update (section 6.3)
                if headers:
                    raise HpackError("dynamic table size update after a header field")
                size = octet & 0x1F
                if size == 0x1F:
                    size, pos = _integer(block, pos, size)
                if size > self._max_table_size:
                    raise HpackError(
                        f"dynamic table size update to {size} exceeds the advertised {self._max_table_size}"
                    )
                self._limit = size
                self._evict(size)
                continue
            else:  # literal without indexing (0000xxxx) or never indexed (0001xxxx), section 6.2.2/6.2.3
                field, pos = self._literal(block, pos, octet & 0x0F, 0x0F)
            list_size += len(field[0]) + len(field[1]) + ENTRY_OVERHEAD
            if list_size > list_limit:
                raise HpackError(f"header list is larger than {list_limit} octets")
            headers.append(field)
        return headers

    def _literal(
        self, block: bytes, pos: int, index: int, prefix_max: int
    ) -> tuple[tuple[bytes, bytes], int]:
        """A literal field whose first octet carried ``index`` (``prefix_max``: the prefix is continued):
        the name by index, or as a string when the index is 0, then the value."""
        if index == prefix_max:
            index, pos = _integer(block, pos, index)
        if index:
            name = self._lookup(index)[0]
        else:
            name, pos = self._string(block, pos)
        value, pos = self._string(block, pos)
        return (name, value), pos

    def _lookup(self, index: int) -> tuple[bytes, bytes]:
        if 0 < index <= _STATIC_COUNT:
            return _STATIC_BY_INDEX[index]
        dynamic = self._dynamic
        if index == 0:
            raise HpackError("header field index 0 is not allowed")
        offset = index - _STATIC_COUNT
        if offset > len(dynamic):
            entries = _STATIC_COUNT + len(dynamic)
            raise HpackError(f"header field index {index} is out of range (table has {entries} entries)")
        return dynamic[-offset]

    def _string(self, block: bytes, pos: int) -> tuple[bytes, int]:
        if pos >= len(block):
            raise HpackError("header block ends before a string literal")
        octet = block[pos]
        pos += 1
        length = octet & 0x7F
        if length == 0x7F:
            length, pos = _integer(block, pos, length)
        stop = pos + length
        if stop > len(block):
            raise HpackError(
                f"string literal of {length} octets runs past the end of the block ({len(block) - pos} left)"
            )
        raw = block[pos:stop]
        if not octet & 0x80:
            return raw, stop
        cache = self._cache
        text = cache.get(raw)
        if text is None:
            text = huffman_decode(raw)
            if length <= _HUFFMAN_CACHE_MAX_OCTETS:
                if len(cache) >= _HUFFMAN_CACHE_ENTRIES:
                    del cache[next(iter(cache))]
                cache[raw] = text
        return text, stop

    def _insert(self, field: tuple[bytes, bytes]) -> None:
        size = len(field[0]) + len(field[1]) + ENTRY_OVERHEAD
        if size > self._limit:  # section 4.4: a too-large entry empties the table and is not added
            self._dynamic.clear()
            self._size = 0
            return
        self._evict(self._limit - size)
        self._dynamic.append(field)
        self._size += size

    def _evict(self, room: int) -> None:
        """Drop the oldest entries until the table takes at most ``room`` octets."""
        dynamic = self._dynamic
        drop = 0
        size = self._size
        while size > room:
            name, value = dynamic[drop]
            size -= len(name) + len(value) + ENTRY_OVERHEAD
            drop += 1
        if drop:
            del dynamic[:drop]
            self._size = size


def encode_integer(value: int, prefix_bits: int, flags: int = 0) -> bytes:
    """An integer in HPACK's prefix form (section 5.1); ``flags`` are the bits above the prefix."""
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes((flags | value,))
    out = bytearray((flags | top,))
    value -= top
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_literal(name: bytes, value: bytes) -> bytes:
    """One header field as a literal without indexing, with a new name and no Huffman coding (section
    6.2.2): what the server's answers use, so the peer's decoder state never depends on them."""
    return b"\x00" + encode_integer(len(name), 7) + name + encode_integer(len(value), 7) + value
