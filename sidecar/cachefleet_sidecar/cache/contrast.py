"""The semantic tier's contrast check: two near-identical questions that ask opposite things (pure).

Sentence embeddings place "enable dark mode" and "disable dark mode" almost
on top of each other (cosine 0.95 with all-MiniLM-L6-v2): the words that
differ are the whole question, and a threshold cannot separate them. After
the lexical guard of :mod:`semantic` (numbers, negations, capitalised
entities, overlap), :func:`contrast` compares the *words that differ*
between the two texts and refuses the pair when they contrast:

* ``antonym``: a word on one side whose opposite is on the other, from
  :data:`ANTONYMS` (hand-written converse pairs: buy/sell, before/after,
  large/small, ascending/descending, ...), matched on base forms so that
  inflections, comparatives and superlatives count (``largest`` /
  ``smallest`` are ``large`` / ``small``);
* ``converse``: a morphological opposite, generated rather than listed: one
  word is the other with a reversing prefix (``install`` / ``uninstall``,
  ``connect`` / ``disconnect``, ``valid`` / ``invalid``), the two share a stem
  under opposed prefixes (``encrypt`` / ``decrypt``, ``import`` / ``export``,
  ``upload`` / ``download``, ``maximize`` / ``minimize``) or opposed suffixes
  (``useful`` / ``useless``, ``employer`` / ``employee``);
* ``order``: the same words around a directional word in the other order
  ("convert fahrenheit to celsius" / "convert celsius to fahrenheit", "is a
  faster than b" / "is b faster than a");
* ``swap``: one content word replaced by another, everything else the same
  (a minimal pair): "dosage of penicillin" / "dosage of amoxicillin",
  "price in euros" / "price in dollars". The substituted word is what the
  question is about, so two such questions are different questions unless
  the two words are forms of one word or listed as synonyms in
  :data:`SYNONYMS` (``fix`` / ``repair``: a miss costs a model call, a false
  hit a wrong answer, so the list only has to cover common rewordings).

No lexical database with antonyms installs offline from PyPI as a wheel
(docs/semantic.md says what was tried), so these are rules and lists written
for cachefleet; ``cachefleet bench semantic`` measures them on a generated
contrast set and on the paraphrase sets.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from functools import lru_cache

#: Words (and word pairs) whose base forms (and opposition) are remembered: bounded caches.
BASES_CACHE = 16384

#: Lower-case words of a text, in order (apostrophes kept: ``don't``; hyphens joined:
#: ``non-zero`` is ``nonzero``).
WORD = re.compile(r"[a-z]+(?:['\u2019-][a-z]+)*")


def _split(text: str) -> list[str]:
    """The whitespace-separated items of a word list written as a block of text."""
    return text.split()


#: Words that carry no topic (the swap rule ignores them; order and antonyms do not).
FUNCTION_WORDS = frozenset(
    _split(
        """
    a an the of to in on for and or is are was were be been being it its this that these
    those with by as at from can could will would should may might must shall do does did
    done has have had having you your yours we our us they them their he him his she her i
    me my mine which what who whom whose how when where why there here than then so such
    into onto also just only any all each some very about if but please tell me get got
    way ways one ones thing things something anything make makes made let lets need needs
    want wants like know show explain describe give find using use used via per
    s t ll ve re d m
    """
    )
)

#: Opposites (both directions apply), as base forms: a word's inflections are reduced first.
ANTONYMS: frozenset[frozenset[str]] = frozenset(
    frozenset(pair.split("/"))
    for pair in _split(
        """
    buy/sell buyer/seller purchase/sell bought/sold long/short bull/bear bullish/bearish
    gain/loss profit/loss credit/debit deposit/withdraw deposit/withdrawal lend/borrow
    lender/borrower income/expense import/export asset/liability rise/fall increase/decrease
    grow/shrink expand/contract raise/lower inflation/deflation surplus/deficit
    close/far near/far closest/farthest nearest/farthest before/after pre/post
    prior/after early/late     earlier/later first/last start/end
    start/finish begin/end beginning/end open/close opened/closed morning/evening
    day/night past/future yesterday/tomorrow old/new older/newer oldest/newest
    ascending/descending ascend/descend asc/desc increasing/decreasing up/down upward/downward
    above/below over/under top/bottom upper/lower high/low higher/lower highest/lowest
    inside/outside internal/external in/out inner/outer inbound/outbound incoming/outgoing
    front/back forward/backward forwards/backwards left/right north/south east/west
    northern/southern eastern/western horizontal/vertical vertically/horizontally
    large/small big/small big/little huge/tiny great/small largest/smallest major/minor
    maximum/minimum max/min most/least more/less more/fewer many/few much/little
    tall/short long/brief wide/narrow thick/thin deep/shallow heavy/light heavier/lighter
    fast/slow quick/slow faster/slower fastest/slowest speed/slow hot/cold warm/cool
    heat/cool hotter/colder warmest/coldest dry/wet hard/soft hard/easy difficult/easy
    strong/weak loud/quiet bright/dark light/dark dark/light cheap/expensive rich/poor
    safe/dangerous safe/unsafe good/bad better/worse best/worst positive/negative
    plus/minus add/subtract addition/subtraction multiply/divide multiplication/division
    true/false correct/incorrect right/wrong accept/reject allow/deny allow/block
    whitelist/blacklist allowlist/denylist permit/forbid include/omit win/lose winner/loser
    pass/fail success/failure succeed/fail attack/defend offense/defense
    push/pull send/receive sender/receiver give/take giver/taker teach/learn
    teacher/student parent/child client/server master/slave leader/follower
    host/guest input/output read/write reader/writer request/response
    question/answer ask/answer sum/difference
    enable/disable enabled/disabled on/off activate/deactivate show/hide
    visible/hidden public/private online/offline present/absent remember/forget
    save/delete save/discard create/delete create/destroy add/remove insert/delete
    attach/detach mount/unmount connect/disconnect login/logout
    upgrade/downgrade install/uninstall encode/decode encrypt/decrypt compress/decompress
    zip/unzip pack/unpack lock/unlock freeze/unfreeze block/unblock ban/unban
    follow/unfollow subscribe/unsubscribe like/dislike agree/disagree approve/disapprove
    upload/download uploading/downloading push/pop enqueue/dequeue serialize/deserialize
    minimize/maximize minimise/maximise shrink/enlarge
    male/female man/woman men/women boy/girl husband/wife father/mother son/daughter
    brother/sister king/queen he/she his/her
    acid/base acidic/alkaline acidic/basic positive/negative anode/cathode cation/anion
    proton/electron oxidation/reduction oxidize/reduce exothermic/endothermic
    solid/liquid liquid/gas freeze/melt freezing/boiling condense/evaporate
    melting/freezing sunrise/sunset summer/winter spring/autumn spring/fall
    hypertension/hypotension hyperthyroidism/hypothyroidism hyper/hypo
    hyperglycemia/hypoglycemia systolic/diastolic inhale/exhale
    benign/malignant acute/chronic arterial/venous artery/vein
    sweet/sour sweet/bitter raw/cooked fresh/frozen fresh/stale
    lowercase/uppercase upper/lower capital/lowercase singular/plural
    synchronous/asynchronous sync/async static/dynamic mutable/immutable
    explicit/implicit absolute/relative global/local remote/local
    stateful/stateless primary/secondary primary/replica major/minor
    ingress/egress inflow/outflow
    import/export importer/exporter importing/exporting
    lossy/lossless greedy/lazy eager/lazy strict/lenient strict/loose
    optimist/pessimist optimistic/pessimistic
    cause/effect cause/prevent attract/repel accelerate/decelerate
    acceleration/deceleration expand/collapse widen/narrow tighten/loosen
    inherit/override overestimate/underestimate overweight/underweight
    overflow/underflow overpaid/underpaid
    """
    )
)

#: Prefixes that reverse or negate the word they precede (``un`` + ``install``).
#: ``re`` is not one: it repeats (``name`` / ``rename`` in a paraphrase), and a question
#: that differs only by it (``install`` / ``reinstall``) is a swap already.
REVERSING_PREFIXES = ("un", "dis", "de", "in", "im", "il", "ir", "non", "anti", "mis", "counter")
#: Prefix pairs of opposed words sharing a stem (``en`` + ``crypt`` / ``de`` + ``crypt``).
OPPOSED_PREFIXES: frozenset[frozenset[str]] = frozenset(
    frozenset(pair.split("/"))
    for pair in _split(
        """
    en/de en/dis em/dis in/ex im/ex in/out in/de im/de a/de as/de up/down over/under
    pre/post pro/anti pro/con max/min maxi/mini hyper/hypo super/sub inter/intra
    micro/macro en/un ac/de at/de con/di
    """
    )
)
#: Suffix pairs of opposed words sharing a stem (``use`` + ``ful`` / ``use`` + ``less``).
OPPOSED_SUFFIXES: frozenset[frozenset[str]] = frozenset(
    frozenset(pair.split("/")) for pair in _split("ful/less er/ee or/ee")
)
#: Opposites are looked for only when at most this many content words differ on each side.
MAX_DIFFERING = 3
#: The shortest stem a prefix or suffix rule accepts (``re`` + ``d`` is not a converse).
MIN_STEM = 3

#: Two words that begin alike for this long are taken as forms of one (``configure``,
#: ``configuration``), never as a swap.
RELATED_PREFIX = 5

#: Words around which order matters: "a to b" is not "b to a".
DIRECTIONAL = frozenset(
    _split("to into from than over under before after above below then onto toward towards")
)

#: Groups of words interchangeable in a question; a swap between two of one group is fine.
SYNONYMS: tuple[frozenset[str], ...] = tuple(
    frozenset(group.split("/"))
    for group in _split(
        """
    fix/repair/mend/resolve/solve big/large/huge/great small/little/tiny begin/start/commence
    end/finish/stop/terminate/complete/cancel/abort/halt quick/fast/rapid/speedy
    quickly/fast/rapidly
    car/automobile/vehicle buy/purchase get/obtain/acquire/receive/fetch
    remove/delete/erase/eliminate/drop change/modify/alter/edit/update/adjust
    make/create/build/generate/produce show/display/print/list/output
    use/utilize/utilise/employ/apply help/assist/aid error/bug/issue/problem/fault
    mistake/error method/way/approach/technique/manner function/method/routine
    step/stage/phase picture/image/photo/photograph movie/film house/home
    job/task/work/chore choose/pick/select cost/price/charge
    combine/merge/join/concatenate/unite check/verify/validate/confirm/inspect/examine
    look/see/view/watch look/appear/seem allow/let/permit/enable
    need/require want/wish/desire say/state/tell/mention talk/speak/chat
    explain/describe/clarify learn/study/master understand/comprehend/grasp
    correct/right/accurate/proper wrong/incorrect/inaccurate good/fine/nice/great
    bad/poor/terrible/awful important/crucial/essential/key/vital main/primary/principal/chief
    optional/voluntary mandatory/required/compulsory/obligatory
    iterate/loop/cycle/traverse over/through/across file/document folder/directory
    run/execute/launch/start load/import/read save/store/keep/write
    send/transmit/deliver return/give/yield give/provide/supply/offer/deliver
    find/locate/discover/identify search/look/seek answer/reply/response
    question/query/inquiry symptom/sign kid/child/children/kids doctor/physician
    medicine/medication/drug/remedy ill/sick illness/sickness/disease
    shop/store buy/shop phone/telephone/cellphone/mobile/smartphone
    laptop/notebook/computer/pc tv/television begin/initiate
    instructions/directions/guidance/steps guide/tutorial/manual handbook/manual
    feature/attribute/property/characteristic field/attribute attribute/column
    dataset/data parameter/argument/option/setting param/parameter arg/argument
    specify/define/set/declare/indicate default/standard inspect/inspection
    modification/alteration/change/edit instead/rather
    retrieve/fetch/load/select/get/obtain/query cast/convert/transform/turn/change
    append/add type/variety/kind/sort/category prevent/avoid/stop book/reserve tall/high
    tallest/highest default/preset refer/consult/see set/establish/configure/define
    specify/determine statement/claim newest/latest cheap/inexpensive
    """
    )
)


def words(text: str) -> tuple[str, ...]:
    """The lower-case words of ``text`` in order (what :func:`contrast` compares)."""
    return tuple(w.replace("-", "") for w in WORD.findall(text.lower()))


@lru_cache(maxsize=BASES_CACHE)
def bases(word: str) -> frozenset[str]:
    """``word`` and the base forms its inflection may come from (``largest`` -> ``large``)."""
    word = word.replace("\u2019", "'").removesuffix("'s")
    out = {word}
    for suffix, endings in _INFLECTIONS:
        if word.endswith(suffix) and len(word) - len(suffix) >= 2:
            stem = word[: -len(suffix)]
            for end in endings:
                out.add(stem + end)
            if len(stem) >= 3 and stem[-1] == stem[-2] and stem[-1] not in "aeiouls":
                out.add(stem[:-1])  # biggest -> big, stopped -> stop
    return frozenset(out)


_INFLECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("iest", ("y",)),
    ("ier", ("y",)),
    ("ies", ("y",)),
    ("ied", ("y",)),
    ("est", ("", "e")),
    ("er", ("", "e")),
    ("ing", ("", "e")),
    ("ed", ("", "e")),
    ("es", ("", "e")),
    ("s", ("",)),
    ("ly", ("", "le")),
)


def _share_base(x: str, y: str) -> bool:
    return bool(bases(x) & bases(y))


def _antonyms(x: str, y: str) -> bool:
    return any(frozenset((bx, by)) in ANTONYMS for bx in bases(x) for by in bases(y) if bx != by)


def _affixed(x: str, y: str) -> bool:
    """``y`` is ``x`` with a reversing prefix, or the two share a stem under opposed affixes."""
    for bx in bases(x):
        for by in bases(y):
            for long, short in ((bx, by), (by, bx)):
                if len(short) >= MIN_STEM and long.endswith(short):
                    prefix = long[: -len(short)].rstrip("-")
                    if prefix in REVERSING_PREFIXES:
                        return True
            for n in range(len(_common_suffix(bx, by)), MIN_STEM, -1):
                if frozenset((bx[:-n], by[:-n])) in OPPOSED_PREFIXES:
                    return True
            for n in range(len(_common_prefix(bx, by)), MIN_STEM - 1, -1):
                if frozenset((bx[n:], by[n:])) in OPPOSED_SUFFIXES:
                    return True
    return False


def _common_suffix(x: str, y: str) -> str:
    n = 0
    while n < min(len(x), len(y)) and x[-1 - n] == y[-1 - n]:
        n += 1
    return x[len(x) - n :] if n else ""


def _common_prefix(x: str, y: str) -> str:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return x[:n]


@lru_cache(maxsize=BASES_CACHE)
def opposed(x: str, y: str) -> str | None:
    """``antonym`` or ``converse`` when two words mean opposite things, else None."""
    if x == y or _share_base(x, y):
        return None
    if _antonyms(x, y):
        return "antonym"
    if _affixed(x, y):
        return "converse"
    return None


def synonyms(x: str, y: str) -> bool:
    """Two forms of one word (a shared base or beginning), or two of one :data:`SYNONYMS` group."""
    if _share_base(x, y) or len(_common_prefix(x, y)) >= RELATED_PREFIX:
        return True
    bx, by = bases(x), bases(y)
    return any(bx & group and by & group for group in SYNONYMS)


def _sides(seq: tuple[str, ...], marker: str) -> tuple[set[str], set[str]]:
    at = seq.index(marker)
    before = {w for w in seq[:at] if w not in FUNCTION_WORDS}
    after = {w for w in seq[at + 1 :] if w not in FUNCTION_WORDS}
    return before, after


def _reordered(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """A word moved across a directional word one way and another word the other way."""
    for marker in DIRECTIONAL:
        if a.count(marker) != 1 or b.count(marker) != 1:
            continue
        before_a, after_a = _sides(a, marker)
        before_b, after_b = _sides(b, marker)
        if (before_a - before_b) & after_b and (after_a - after_b) & before_b:
            return True
    return False


def _content(counts: Counter[str]) -> list[str]:
    return [w for w in counts.elements() if w not in FUNCTION_WORDS]


def contrast(a: tuple[str, ...], b: tuple[str, ...]) -> str | None:
    """Why two word sequences ask opposite or different things, or None (see the module doc).

    Only near-identical texts are compared: opposites count when at most
    :data:`MAX_DIFFERING` content words differ on each side (in two long
    paraphrases, an ``in`` on one side and an ``out`` on the other mean
    nothing), order when both have the same content words, and a swap when
    one content word differs on each side and at most one function word.
    """
    if a == b:
        return None
    ca, cb = Counter(a), Counter(b)
    only_a, only_b = ca - cb, cb - ca
    da, db = _content(only_a), _content(only_b)
    if len(da) <= MAX_DIFFERING and len(db) <= MAX_DIFFERING:
        for x in only_a:
            for y in only_b:
                reason = opposed(x, y)
                if reason is not None:
                    return reason
    if not da and not db and _reordered(a, b):
        return "order"
    small = len(only_a) <= 2 and len(only_b) <= 2
    if small and len(da) == 1 and len(db) == 1 and _swapped(da[0], db[0], a, b):
        return "swap"
    return None


def _swapped(x: str, y: str, a: Iterable[str], b: Iterable[str]) -> bool:
    """One content word replaced by an unrelated one, with content shared around it."""
    if synonyms(x, y):
        return False
    shared = {w for w in a if w not in FUNCTION_WORDS} & {w for w in b if w not in FUNCTION_WORDS}
    return len(shared) >= 1
