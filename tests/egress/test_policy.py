"""EgressPolicy: parsing, one canonical form, wildcards, IDNA, ports, narrowing under a ceiling."""

from __future__ import annotations

import ipaddress

import pytest

from coderunner.policy.egress import CEILING_SETTING, PRESETS, EgressPolicy, EgressPolicyError, normalize_host


def test_presets_expand_and_python_packages_comes_from_pip() -> None:
    from pip._internal.models.index import PyPI

    policy = EgressPolicy.parse(["python-packages", "github"])
    assert PyPI.netloc in policy.hosts and PyPI.file_storage_domain in policy.hosts
    assert policy.allows(PyPI.netloc, 443) and policy.allows(PyPI.file_storage_domain, 443)
    for host in ("github.com", "api.github.com", "codeload.github.com", "raw.githubusercontent.com"):
        assert policy.allows(host, 443), host
    assert set(PRESETS) >= {"python-packages", "github"}


def test_names_are_compared_in_one_canonical_form() -> None:
    policy = EgressPolicy.parse(["Data.Example.COM.", "bücher.de"])
    assert policy.hosts == ("data.example.com", "xn--bcher-kva.de")
    assert policy.allows("DATA.example.com", 443)
    assert policy.allows("data.example.com.", 443)
    assert policy.allows("ｄａｔａ.example。com", 443)  # fullwidth letters and ideographic dot map to ASCII
    assert policy.allows("BÜCHER.de", 443)
    assert policy.allows("xn--bcher-kva.de", 80)
    assert not policy.allows("other.example.com", 443)


def test_wildcards_match_subdomains_not_the_apex_nor_lookalikes() -> None:
    policy = EgressPolicy.parse(["*.example.com"])
    assert policy.allows("a.example.com", 443)
    assert policy.allows("a.b.example.com", 443)
    assert not policy.allows("example.com", 443)
    assert not policy.allows("badexample.com", 443)
    assert not policy.allows("example.com.evil.org", 443)


def test_ip_literals_match_only_ip_entries() -> None:
    policy = EgressPolicy.parse(["203.0.113.80", "[2001:DB8::1]", "2001:db8::2", "example.com"])
    assert policy.hosts == ("203.0.113.80", "2001:db8::1", "2001:db8::2", "example.com")
    assert policy.allows("203.0.113.80", 443)
    assert policy.allows("[2001:db8:0::1]", 443)
    assert policy.allows("2001:db8::2", 443)
    assert not policy.allows("203.0.113.81", 443)
    wild = EgressPolicy.parse(["*.example.com"])
    assert not wild.allows("1.2.3.4", 443)


def test_ports_default_and_are_checked() -> None:
    policy = EgressPolicy.parse(["example.com"])
    assert policy.ports == frozenset({80, 443})
    assert not policy.allows("example.com", 22)
    assert EgressPolicy.parse(["example.com"], ports=[8443]).allows("example.com", 8443)
    for bad in ([0], [65536], [-1], [True], ["443"], []):
        with pytest.raises(EgressPolicyError):
            EgressPolicy.parse(["example.com"], ports=bad)


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("", "empty"),
        ("*", "wildcard"),
        ("*.com", "top-level"),
        ("*.co.uk", "top-level"),
        ("*.*.example.com", "wildcard"),
        ("a*.example.com", "wildcard"),
        ("a..example.com", "empty label"),
        (".example.com", "empty label"),
        ("-bad.example.com", "invalid label"),
        ("exa mple.com", "space"),
        ("example.com\x00", "control"),
        ("https://example.com/", "URL"),
        ("example.com:443", "port"),
        ("2130706433", "number"),
        ("0x7f.0x1", "number"),
        ("[127.0.0.1]", "IPv6"),
        ("fe80::1%eth0", "zone"),
        ("xn--zz.example.com", "punycode"),
        ("a" * 64 + ".example.com", "invalid label"),
        (("abcdefghi." * 26) + "com", "longer"),
    ],
)
def test_garbage_entries_are_refused_with_a_reason(entry: str, says: str) -> None:
    with pytest.raises(EgressPolicyError) as info:
        EgressPolicy.parse([entry])
    assert says.lower() in str(info.value).lower()


def test_allows_never_raises_on_garbage_hosts() -> None:
    policy = EgressPolicy.parse(["*.example.com", "example.com"])
    for host in ("", "..", "[", "]", "[::1", "a b.example.com", "\x00", "é" * 300, "*.example.com", "x" * 5000):
        assert policy.allows(host, 443) is False


def test_narrowed_is_a_subset_and_beyond_the_ceiling_names_the_setting() -> None:
    ceiling = EgressPolicy.parse(["github", "*.example.com", "mirror.internal"], ports=[443])
    session = ceiling.narrowed(["api.github.com", "*.data.example.com", "Mirror.internal"])
    assert session.hosts == ("api.github.com", "*.data.example.com", "mirror.internal")
    assert session.ports == frozenset({443})
    assert session.allows("x.data.example.com", 443)
    assert not session.allows("github.com", 443)
    with pytest.raises(EgressPolicyError) as info:
        ceiling.narrowed(["api.github.com", "evil.org", "*.com.example.org"])
    message = str(info.value)
    assert "`evil.org`" in message and CEILING_SETTING in message
    with pytest.raises(EgressPolicyError):
        ceiling.narrowed(["example.com"])  # the apex is not under *.example.com
    with pytest.raises(EgressPolicyError):
        ceiling.narrowed(["*.github.io"])
    assert ceiling.narrowed([]).hosts == ()


def test_with_host_adds_one_exact_host() -> None:
    policy = EgressPolicy.parse(["example.com"])
    wider = policy.with_host("Files.Example.com")
    assert wider.hosts == ("example.com", "files.example.com")
    assert wider.with_host("files.example.com") is wider
    with pytest.raises(EgressPolicyError):
        policy.with_host("*.example.com")


def test_describe_is_short() -> None:
    many = EgressPolicy.parse([f"h{i}.example.com" for i in range(30)], ports=[443])
    text = many.describe()
    assert "and 22 more" in text and "port 443" in text and len(text) < 200
    assert EgressPolicy.parse([]).describe().startswith("no hosts")


def test_normalize_host_forms() -> None:
    assert normalize_host("[::FFFF:127.0.0.1]") == str(ipaddress.IPv6Address("::ffff:127.0.0.1"))
    assert normalize_host("127.0.0.1") == "127.0.0.1"
    assert normalize_host("EXAMPLE.com.") == "example.com"
    for bad in ("", "[::1", "::1]", "[example.com]", "a..b", "127.1", "0x7f000001"):
        with pytest.raises(EgressPolicyError):
            normalize_host(bad)


def test_entry_for_names_the_preset_a_host_needs_when_the_ceiling_holds_all_of_it() -> None:
    """pip needs the index and its file host: a hint naming one host alone leaves pip failing on the other."""
    index, files = PRESETS["python-packages"]
    whole = EgressPolicy.parse(["python-packages", "example.com"])
    assert whole.entry_for(index) == "python-packages" and whole.entry_for(files.upper()) == "python-packages"
    assert whole.entry_for("example.com") == "example.com"
    assert EgressPolicy.parse(["*.github.com", "github.com", "*.githubusercontent.com"]).entry_for(
        "api.github.com"
    ) == ("github")
    only_index = EgressPolicy.parse([index])  # the preset is not wholly inside this ceiling: the host itself
    assert only_index.entry_for(index) == index
    # The hint never names more than the ceiling: asking for the named entry is accepted by narrowed().
    for policy, host in ((whole, index), (only_index, index)):
        policy.narrowed([policy.entry_for(host)])
    assert whole.entry_for("not a host!") == "not a host!"
