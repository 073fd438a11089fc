"""URL inputs judged without the network: which URLs may be fetched, and which addresses may be connected to.

The API checks a URL's syntax here at the door; the fetch stage checks every address each hop resolves to, and
where a redirect leads. Nothing here resolves a name or opens a socket.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network
from urllib.parse import quote, urljoin, urlsplit

from stoker.core.errors import FetchFailed, UrlRejected

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

#: Longest URL accepted at the door.
MAX_URL_CHARS = 2048
DEFAULT_PORTS = {"http": 80, "https": 443}
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
#: Cloud metadata services, named as such in a rejection (their ranges are refused anyway).
METADATA_ADDRESSES: frozenset[IPAddress] = frozenset(
    ip_address(a) for a in ("169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200")
)
_NAT64 = ip_network("64:ff9b::/96")
_HOSTNAME = re.compile(r"[a-z0-9_](?:[a-z0-9_.-]*[a-z0-9_.])?")


@dataclass(frozen=True)
class Target:
    """One URL that passed the syntax check, in the parts a fetch needs."""

    url: str
    scheme: str
    #: Lower case, IDNA-encoded, an IPv6 address without brackets.
    host: str
    port: int
    #: Path and query as sent on the request line, ASCII only.
    path: str

    @property
    def host_header(self) -> str:
        """The Host header: the name the client asked for, whatever address the connection goes to."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"


def parse_url(url: str) -> Target:
    """Check a URL's syntax: http or https, a host, no credentials, a valid port; raises UrlRejected."""
    if len(url) > MAX_URL_CHARS:
        raise UrlRejected(f"the URL is longer than {MAX_URL_CHARS} characters")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise UrlRejected("the URL contains whitespace or control characters")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed [IPv6 address
        raise UrlRejected("the URL is malformed") from exc
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise UrlRejected(f"only http and https URLs are fetched, not {scheme or 'a relative URL'}")
    if "@" in parts.netloc:
        raise UrlRejected("URLs with credentials are not fetched")
    try:
        port = parts.port
    except ValueError as exc:
        raise UrlRejected("the URL's port is not a number in 1-65535") from exc
    if port == 0:
        raise UrlRejected("the URL's port is not a number in 1-65535")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(url, scheme, _canonical_host(parts.hostname or ""), port or DEFAULT_PORTS[scheme], _ascii(path))


def _canonical_host(host: str) -> str:
    """The host as compared and sent: an IP address as written by ipaddress, a name lower case and IDNA-encoded."""
    if not host:
        raise UrlRejected("the URL has no host")
    try:
        return str(ip_address(host))
    except ValueError:
        pass
    try:
        name = host.encode("idna").decode("ascii").lower()
    except UnicodeError as exc:
        raise UrlRejected("the URL's host is not a valid name") from exc
    if not _HOSTNAME.fullmatch(name):
        raise UrlRejected("the URL's host is not a valid name")
    return name


def _ascii(path: str) -> str:
    """Percent-encode what is not ASCII, as a browser would; everything else is sent as given."""
    return "".join(c if c.isascii() else quote(c) for c in path)


def forbidden_reason(address: IPAddress) -> str | None:
    """Why stoker must not connect to this address, or None when it may (a public unicast address)."""
    if address in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if isinstance(address, IPv6Address):
        embedded, translated = _embedded_ipv4(address)
        if embedded is not None:
            reason = forbidden_reason(embedded)
            if reason is not None or translated:  # a mapped or NAT64 address reaches the IPv4 one, nothing else
                return f"{reason} (as {address})" if reason else None
    return _range_reason(address)


def _range_reason(address: IPAddress) -> str | None:
    checks = (
        ("an unspecified", address.is_unspecified),
        ("a loopback", address.is_loopback),
        ("a link-local", address.is_link_local),
        ("a multicast", address.is_multicast),
        ("a reserved", address.is_reserved),
        ("a private", address.is_private),
        ("a site-local", isinstance(address, IPv6Address) and address.is_site_local),
        ("a non-public", not address.is_global),
    )
    return next((f"{name} address" for name, hit in checks if hit), None)


def _embedded_ipv4(address: IPv6Address) -> tuple[IPv4Address | None, bool]:
    """The IPv4 address an IPv6 one carries, and whether connecting to it reaches exactly that address."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped, True
    if address in _NAT64:
        return IPv4Address(int(address) & 0xFFFFFFFF), True
    if address.sixtofour is not None:
        return address.sixtofour, False
    if address.teredo is not None:
        return address.teredo[1], False
    return None, False


@dataclass(frozen=True)
class AllowEntry:
    """One allowlist entry: a host name or a network (a single address is a /32 or /128), on one port or any."""

    host: str | None = None
    network: IPNetwork | None = None
    port: int | None = None

    def allows(self, host: str, port: int, address: IPAddress) -> bool:
        """Whether this entry lets a connection to address, for host on port, through."""
        if self.port is not None and self.port != port:
            return False
        if self.host is not None:
            return self.host == host
        return self.network is not None and address.version == self.network.version and address in self.network


@dataclass(frozen=True)
class Allowlist:
    """Hosts, addresses and networks that may be fetched although they are private (tests, private deployments)."""

    entries: tuple[AllowEntry, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Allowlist:
        """From a comma-separated list: `files.internal`, `files.internal:8443`, `10.1.2.3`, `127.0.0.1:8080`,
        `[::1]:8080`, `10.0.0.0/8`, `fd00::/8`. Raises ValueError on an entry that is none of these."""
        return cls(tuple(_parse_entry(item.strip()) for item in text.split(",") if item.strip()))

    def allows(self, host: str, port: int, address: IPAddress) -> bool:
        """Whether any entry lets this connection through."""
        return any(entry.allows(host, port, address) for entry in self.entries)


def _parse_entry(text: str) -> AllowEntry:
    if "/" in text:
        return AllowEntry(network=ip_network(text, strict=False))
    host, port = _split_port(text)
    try:
        return AllowEntry(network=ip_network(host), port=port)
    except ValueError:
        pass
    name = host.lower()
    if not _HOSTNAME.fullmatch(name):
        raise ValueError(f"allowlist entry {text!r} is not a host, address or network")
    return AllowEntry(host=name, port=port)


def _split_port(text: str) -> tuple[str, int | None]:
    """`host:port`, `[v6]:port`, or a bare host or address (an IPv6 address has more than one colon)."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError(f"allowlist entry {text!r} is not [address]:port")
        return host, _port(rest[1:]) if rest else None
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, _port(port)
    return text, None


def _port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is not in 1-65535")
    return port


def vet_addresses(target: Target, addresses: list[IPAddress], allowlist: Allowlist) -> list[IPAddress]:
    """The addresses a hop may connect to: all of them, or UrlRejected when any is forbidden and not allowlisted.

    One bad address is enough: which one a client library would pick is not ours to guess.
    """
    if not addresses:
        raise FetchFailed(f"{target.host} has no address")
    for address in addresses:
        reason = None if allowlist.allows(target.host, target.port, address) else forbidden_reason(address)
        if reason is not None:
            # The kind of address, never the address: a tenant must not map the private network through stoker.
            named = target.host.strip("[]") == str(address)
            raise UrlRejected(f"{target.host} is {reason}" if named else f"{target.host} resolves to {reason}")
    return addresses


def redirect_location(current: Target, status: int, location: str | None) -> str | None:
    """Where a response sends the fetch next, as an absolute URL; None when it is not a redirect."""
    if status not in REDIRECT_STATUSES:
        return None
    if not location:
        raise FetchFailed(f"{current.host} answered {status} without a Location")
    try:
        return urljoin(current.url, location.strip())
    except ValueError as exc:
        raise UrlRejected(f"{current.host} redirects to a malformed URL") from exc
