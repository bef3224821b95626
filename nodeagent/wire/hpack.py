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

# Huffman codes of RFC 7541 Appendix B as (code, length in bits), symbols 0..255 and EOS (256).
_HUFFMAN_CODES: Final[tuple[tuple[int, int], ...]] = (
    (0x1FF8, 13),
    (0x7FFFD8, 23),
    (0xFFFFFE2, 28),
    (0xFFFFFE3, 28),
    (0xFFFFFE4, 28),  # 0
    (0xFFFFFE5, 28),
    (0xFFFFFE6, 28),
    (0xFFFFFE7, 28),
    (0xFFFFFE8, 28),
    (0xFFFFEA, 24),  # 5
    (0x3FFFFFFC, 30),
    (0xFFFFFE9, 28),
    (0xFFFFFEA, 28),
    (0x3FFFFFFD, 30),
    (0xFFFFFEB, 28),  # 10
    (0xFFFFFEC, 28),
    (0xFFFFFED, 28),
    (0xFFFFFEE, 28),
    (0xFFFFFEF, 28),
    (0xFFFFFF0, 28),  # 15
    (0xFFFFFF1, 28),
    (0xFFFFFF2, 28),
    (0x3FFFFFFE, 30),
    (0xFFFFFF3, 28),
    (0xFFFFFF4, 28),  # 20
    (0xFFFFFF5, 28),
    (0xFFFFFF6, 28),
    (0xFFFFFF7, 28),
    (0xFFFFFF8, 28),
    (0xFFFFFF9, 28),  # 25
    (0xFFFFFFA, 28),
    (0xFFFFFFB, 28),
    (0x14, 6),
    (0x3F8, 10),
    (0x3F9, 10),  # 30
    (0xFFA, 12),
    (0x1FF9, 13),
    (0x15, 6),
    (0xF8, 8),
    (0x7FA, 11),  # 35
    (0x3FA, 10),
    (0x3FB, 10),
    (0xF9, 8),
    (0x7FB, 11),
    (0xFA, 8),  # 40
    (0x16, 6),
    (0x17, 6),
    (0x18, 6),
    (0x0, 5),
    (0x1, 5),  # 45
    (0x2, 5),
    (0x19, 6),
    (0x1A, 6),
    (0x1B, 6),
    (0x1C, 6),  # 50
    (0x1D, 6),
    (0x1E, 6),
    (0x1F, 6),
    (0x5C, 7),
    (0xFB, 8),  # 55
    (0x7FFC, 15),
    (0x20, 6),
    (0xFFB, 12),
    (0x3FC, 10),
    (0x1FFA, 13),  # 60
    (0x21, 6),
    (0x5D, 7),
    (0x5E, 7),
    (0x5F, 7),
    (0x60, 7),  # 65
    (0x61, 7),
    (0x62, 7),
    (0x63, 7),
    (0x64, 7),
    (0x65, 7),  # 70
    (0x66, 7),
    (0x67, 7),
    (0x68, 7),
    (0x69, 7),
    (0x6A, 7),  # 75
    (0x6B, 7),
    (0x6C, 7),
    (0x6D, 7),
    (0x6E, 7),
    (0x6F, 7),  # 80
    (0x70, 7),
    (0x71, 7),
    (0x72, 7),
    (0xFC, 8),
    (0x73, 7),  # 85
    (0xFD, 8),
    (0x1FFB, 13),
    (0x7FFF0, 19),
    (0x1FFC, 13),
    (0x3FFC, 14),  # 90
    (0x22, 6),
    (0x7FFD, 15),
    (0x3, 5),
    (0x23, 6),
    (0x4, 5),  # 95
    (0x24, 6),
    (0x5, 5),
    (0x25, 6),
    (0x26, 6),
    (0x27, 6),  # 100
    (0x6, 5),
    (0x74, 7),
    (0x75, 7),
    (0x28, 6),
    (0x29, 6),  # 105
    (0x2A, 6),
    (0x7, 5),
    (0x2B, 6),
    (0x76, 7),
    (0x2C, 6),  # 110
    (0x8, 5),
    (0x9, 5),
    (0x2D, 6),
    (0x77, 7),
    (0x78, 7),  # 115
    (0x79, 7),
    (0x7A, 7),
    (0x7B, 7),
    (0x7FFE, 15),
    (0x7FC, 11),  # 120
    (0x3FFD, 14),
    (0x1FFD, 13),
    (0xFFFFFFC, 28),
    (0xFFFE6, 20),
    (0x3FFFD2, 22),  # 125
    (0xFFFE7, 20),
    (0xFFFE8, 20),
    (0x3FFFD3, 22),
    (0x3FFFD4, 22),
    (0x3FFFD5, 22),  # 130
    (0x7FFFD9, 23),
    (0x3FFFD6, 22),
    (0x7FFFDA, 23),
    (0x7FFFDB, 23),
    (0x7FFFDC, 23),  # 135
    (0x7FFFDD, 23),
    (0x7FFFDE, 23),
    (0xFFFFEB, 24),
    (0x7FFFDF, 23),
    (0xFFFFEC, 24),  # 140
    (0xFFFFED, 24),
    (0x3FFFD7, 22),
    (0x7FFFE0, 23),
    (0xFFFFEE, 24),
    (0x7FFFE1, 23),  # 145
    (0x7FFFE2, 23),
    (0x7FFFE3, 23),
    (0x7FFFE4, 23),
    (0x1FFFDC, 21),
    (0x3FFFD8, 22),  # 150
    (0x7FFFE5, 23),
    (0x3FFFD9, 22),
    (0x7FFFE6, 23),
    (0x7FFFE7, 23),
    (0xFFFFEF, 24),  # 155
    (0x3FFFDA, 22),
    (0x1FFFDD, 21),
    (0xFFFE9, 20),
    (0x3FFFDB, 22),
    (0x3FFFDC, 22),  # 160
    (0x7FFFE8, 23),
    (0x7FFFE9, 23),
    (0x1FFFDE, 21),
    (0x7FFFEA, 23),
    (0x3FFFDD, 22),  # 165
    (0x3FFFDE, 22),
    (0xFFFFF0, 24),
    (0x1FFFDF, 21),
    (0x3FFFDF, 22),
    (0x7FFFEB, 23),  # 170
    (0x7FFFEC, 23),
    (0x1FFFE0, 21),
    (0x1FFFE1, 21),
    (0x3FFFE0, 22),
    (0x1FFFE2, 21),  # 175
    (0x7FFFED, 23),
    (0x3FFFE1, 22),
    (0x7FFFEE, 23),
    (0x7FFFEF, 23),
    (0xFFFEA, 20),  # 180
    (0x3FFFE2, 22),
    (0x3FFFE3, 22),
    (0x3FFFE4, 22),
    (0x7FFFF0, 23),
    (0x3FFFE5, 22),  # 185
    (0x3FFFE6, 22),
    (0x7FFFF1, 23),
    (0x3FFFFE0, 26),
    (0x3FFFFE1, 26),
    (0xFFFEB, 20),  # 190
    (0x7FFF1, 19),
    (0x3FFFE7, 22),
    (0x7FFFF2, 23),
    (0x3FFFE8, 22),
    (0x1FFFFEC, 25),  # 195
    (0x3FFFFE2, 26),
    (0x3FFFFE3, 26),
    (0x3FFFFE4, 26),
    (0x7FFFFDE, 27),
    (0x7FFFFDF, 27),  # 200
    (0x3FFFFE5, 26),
    (0xFFFFF1, 24),
    (0x1FFFFED, 25),
    (0x7FFF2, 19),
    (0x1FFFE3, 21),  # 205
    (0x3FFFFE6, 26),
    (0x7FFFFE0, 27),
    (0x7FFFFE1, 27),
    (0x3FFFFE7, 26),
    (0x7FFFFE2, 27),  # 210
    (0xFFFFF2, 24),
    (0x1FFFE4, 21),
    (0x1FFFE5, 21),
    (0x3FFFFE8, 26),
    (0x3FFFFE9, 26),  # 215
    (0xFFFFFFD, 28),
    (0x7FFFFE3, 27),
    (0x7FFFFE4, 27),
    (0x7FFFFE5, 27),
    (0xFFFEC, 20),  # 220
    (0xFFFFF3, 24),
    (0xFFFED, 20),
    (0x1FFFE6, 21),
    (0x3FFFE9, 22),
    (0x1FFFE7, 21),  # 225
    (0x1FFFE8, 21),
    (0x7FFFF3, 23),
    (0x3FFFEA, 22),
    (0x3FFFEB, 22),
    (0x1FFFFEE, 25),  # 230
    (0x1FFFFEF, 25),
    (0xFFFFF4, 24),
    (0xFFFFF5, 24),
    (0x3FFFFEA, 26),
    (0x7FFFF4, 23),  # 235
    (0x3FFFFEB, 26),
    (0x7FFFFE6, 27),
    (0x3FFFFEC, 26),
    (0x3FFFFED, 26),
    (0x7FFFFE7, 27),  # 240
    (0x7FFFFE8, 27),
    (0x7FFFFE9, 27),
    (0x7FFFFEA, 27),
    (0x7FFFFEB, 27),
    (0xFFFFFFE, 28),  # 245
    (0x7FFFFEC, 27),
    (0x7FFFFED, 27),
    (0x7FFFFEE, 27),
    (0x7FFFFEF, 27),
    (0x7FFFFF0, 27),  # 250
    (0x3FFFFEE, 26),
    (0x3FFFFFFF, 30),  # 255
)
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
