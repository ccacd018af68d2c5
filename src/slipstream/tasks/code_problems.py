"""The built-in code problems: 50 small functions, each a signature, a prompt, a reference solution
and hidden test inputs. Expected outputs are computed from the (trusted) reference solutions on the
host, so they never enter a sandbox; a candidate only ever sees the inputs.

Written for this project. Not covered: problems needing stdin/stdout, files, or randomness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CodeProblem:
    name: str
    """Function name (also the problem key)."""
    signature: str
    description: str
    reference: str
    """Reference solution source (defines `name`)."""
    tests: tuple[tuple[Any, ...], ...]
    """Argument tuples of the hidden tests."""

    @property
    def prompt(self) -> str:
        return (
            f"Write a Python function `{self.signature}`.\n{self.description}\n"
            "Answer with the complete function in a ```python code block.\n"
        )


def _p(name: str, signature: str, description: str, reference: str, tests: list) -> CodeProblem:
    return CodeProblem(
        name,
        signature,
        description,
        reference.strip() + "\n",
        tuple(t if isinstance(t, tuple) else (t,) for t in tests),
    )


PROBLEMS: list[CodeProblem] = [
    _p(
        "add",
        "def add(a: int, b: int) -> int",
        "Return a + b.",
        "def add(a, b):\n    return a + b",
        [(1, 2), (-5, 5), (10**20, 1), (0, 0)],
    ),
    _p(
        "is_even",
        "def is_even(n: int) -> bool",
        "Return True if n is even.",
        "def is_even(n):\n    return n % 2 == 0",
        [0, 1, -3, 10**12, 7],
    ),
    _p(
        "factorial",
        "def factorial(n: int) -> int",
        "Return n! for n >= 0.",
        "def factorial(n):\n    r = 1\n    for i in range(2, n + 1):\n        r *= i\n    return r",
        [0, 1, 5, 10, 20],
    ),
    _p(
        "fibonacci",
        "def fibonacci(n: int) -> int",
        "Return the n-th Fibonacci number (F(0)=0, F(1)=1).",
        "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
        [0, 1, 2, 10, 50, 90],
    ),
    _p(
        "reverse_string",
        "def reverse_string(s: str) -> str",
        "Return s reversed.",
        "def reverse_string(s):\n    return s[::-1]",
        ["", "a", "hello", "racecar", "ab cd"],
    ),
    _p(
        "is_palindrome",
        "def is_palindrome(s: str) -> bool",
        "Return True if s reads the same backwards, ignoring case and non-alphanumeric characters.",
        "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]",
        ["", "A man, a plan, a canal: Panama", "abc", "No lemon, no melon", "ab"],
    ),
    _p(
        "count_vowels",
        "def count_vowels(s: str) -> int",
        "Count the vowels (aeiou, either case) in s.",
        "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)",
        ["", "hello", "AEIOU", "rhythm", "Programming Language"],
    ),
    _p(
        "max_of_list",
        "def max_of_list(xs: list[int]) -> int",
        "Return the largest element of a non-empty list.",
        "def max_of_list(xs):\n    return max(xs)",
        [([3, 1, 2],), ([-5, -2],), ([7],), ([1, 9, 9, 0],)],
    ),
    _p(
        "sum_of_squares",
        "def sum_of_squares(n: int) -> int",
        "Return 1^2 + 2^2 + ... + n^2 (0 for n <= 0).",
        "def sum_of_squares(n):\n    return sum(i * i for i in range(1, n + 1))",
        [0, 1, 3, 10, 1000, -4],
    ),
    _p(
        "gcd",
        "def gcd(a: int, b: int) -> int",
        "Return the greatest common divisor of a and b (non-negative).",
        "def gcd(a, b):\n    a, b = abs(a), abs(b)\n    while b:\n        a, b = b, a % b\n    return a",
        [(12, 18), (17, 5), (0, 9), (-24, 36), (0, 0)],
    ),
    _p(
        "lcm",
        "def lcm(a: int, b: int) -> int",
        "Return the least common multiple of positive a and b.",
        "def lcm(a, b):\n    x, y = a, b\n    while y:\n        x, y = y, x % y\n    return a * b // x",
        [(4, 6), (7, 3), (10, 10), (1, 99), (12, 18)],
    ),
    _p(
        "is_prime",
        "def is_prime(n: int) -> bool",
        "Return True if n is a prime number.",
        "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0:\n            return False\n        i += 1\n    return True",
        [0, 1, 2, 17, 21, 7919, 1000003, -7],
    ),
    _p(
        "primes_below",
        "def primes_below(n: int) -> list[int]",
        "Return all primes p < n in increasing order.",
        "def primes_below(n):\n    return [p for p in range(2, n) if all(p % d for d in range(2, int(p ** 0.5) + 1))]",
        [0, 2, 3, 20, 100],
    ),
    _p(
        "digit_sum",
        "def digit_sum(n: int) -> int",
        "Return the sum of the decimal digits of |n|.",
        "def digit_sum(n):\n    return sum(int(c) for c in str(abs(n)))",
        [0, 7, 123, -456, 10**18 - 1],
    ),
    _p(
        "count_words",
        "def count_words(s: str) -> int",
        "Return the number of whitespace-separated words in s.",
        "def count_words(s):\n    return len(s.split())",
        ["", "one", "two words", "  spaced   out  ", "a\tb\nc"],
    ),
    _p(
        "capitalize_words",
        "def capitalize_words(s: str) -> str",
        "Upper-case the first letter of each space-separated word, leaving the rest unchanged; keep spaces as they are.",
        "def capitalize_words(s):\n    return ' '.join(w[:1].upper() + w[1:] for w in s.split(' '))",
        ["", "hello world", "a  b", "already Capital", "x"],
    ),
    _p(
        "flatten",
        "def flatten(xs: list) -> list",
        "Flatten arbitrarily nested lists into one list, left to right.",
        "def flatten(xs):\n    out = []\n    for x in xs:\n        if isinstance(x, list):\n            out.extend(flatten(x))\n        else:\n            out.append(x)\n    return out",
        [([],), ([1, [2, [3, [4]]]],), ([[[]]],), ([1, 2, 3],), ([["a"], "b"],)],
    ),
    _p(
        "unique_sorted",
        "def unique_sorted(xs: list[int]) -> list[int]",
        "Return the distinct elements of xs in increasing order.",
        "def unique_sorted(xs):\n    return sorted(set(xs))",
        [([],), ([3, 1, 3, 2],), ([5, 5, 5],), ([-1, 2, -1],)],
    ),
    _p(
        "second_largest",
        "def second_largest(xs: list[int]) -> int | None",
        "Return the second largest distinct value, or None if there is none.",
        "def second_largest(xs):\n    s = sorted(set(xs))\n    return s[-2] if len(s) >= 2 else None",
        [([1, 2, 3],), ([5, 5],), ([],), ([10, 9, 10, 8],), ([-3, -1],)],
    ),
    _p(
        "running_sum",
        "def running_sum(xs: list[int]) -> list[int]",
        "Return the prefix sums of xs.",
        "def running_sum(xs):\n    out, t = [], 0\n    for x in xs:\n        t += x\n        out.append(t)\n    return out",
        [([],), ([1, 2, 3],), ([5, -5, 5],), ([0],)],
    ),
    _p(
        "rotate_left",
        "def rotate_left(xs: list, k: int) -> list",
        "Rotate xs left by k positions (k may exceed len(xs)).",
        "def rotate_left(xs, k):\n    if not xs:\n        return []\n    k %= len(xs)\n    return xs[k:] + xs[:k]",
        [([1, 2, 3, 4], 1), ([1, 2, 3], 5), ([], 3), ([1], 0), (["a", "b"], 2)],
    ),
    _p(
        "chunk",
        "def chunk(xs: list, n: int) -> list[list]",
        "Split xs into consecutive chunks of size n (the last may be shorter).",
        "def chunk(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs), n)]",
        [([1, 2, 3, 4, 5], 2), ([], 3), ([1, 2], 5), ([1, 2, 3], 1)],
    ),
    _p(
        "char_frequency",
        "def char_frequency(s: str) -> dict[str, int]",
        "Map each character of s to its count.",
        "def char_frequency(s):\n    d = {}\n    for c in s:\n        d[c] = d.get(c, 0) + 1\n    return d",
        ["", "hello", "aaa", "abcabc"],
    ),
    _p(
        "most_common_char",
        "def most_common_char(s: str) -> str",
        "Return the most frequent character of a non-empty s; ties go to the character that appears first.",
        "def most_common_char(s):\n    best = s[0]\n    for c in s:\n        if s.count(c) > s.count(best):\n            best = c\n    return best",
        ["a", "hello", "abcabcc", "zzyy", "mississippi"],
    ),
    _p(
        "is_anagram",
        "def is_anagram(a: str, b: str) -> bool",
        "Return True if a and b are anagrams (case-sensitive, all characters).",
        "def is_anagram(a, b):\n    return sorted(a) == sorted(b)",
        [("listen", "silent"), ("a", "b"), ("", ""), ("ab", "abb"), ("Dog", "god")],
    ),
    _p(
        "caesar",
        "def caesar(s: str, k: int) -> str",
        "Shift each ASCII letter of s by k places (wrapping, keeping case); leave other characters.",
        "def caesar(s, k):\n    out = []\n    for c in s:\n        if 'a' <= c <= 'z':\n            out.append(chr((ord(c) - 97 + k) % 26 + 97))\n        elif 'A' <= c <= 'Z':\n            out.append(chr((ord(c) - 65 + k) % 26 + 65))\n        else:\n            out.append(c)\n    return ''.join(out)",
        [("abc", 1), ("xyz", 3), ("Hello, World!", 13), ("", 5), ("abc", -1)],
    ),
    _p(
        "binary_string",
        "def binary_string(n: int) -> str",
        "Return the binary representation of n >= 0 without prefix.",
        "def binary_string(n):\n    return bin(n)[2:]",
        [0, 1, 5, 255, 1024],
    ),
    _p(
        "from_roman",
        "def from_roman(s: str) -> int",
        "Convert a valid Roman numeral to an integer.",
        "def from_roman(s):\n    v = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}\n    t = 0\n    for i, c in enumerate(s):\n        if i + 1 < len(s) and v[c] < v[s[i + 1]]:\n            t -= v[c]\n        else:\n            t += v[c]\n    return t",
        ["III", "IV", "IX", "LVIII", "MCMXCIV", "MMXXIV"],
    ),
    _p(
        "to_roman",
        "def to_roman(n: int) -> str",
        "Convert 1 <= n <= 3999 to a Roman numeral.",
        "def to_roman(n):\n    vals = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'), (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I')]\n    out = ''\n    for v, r in vals:\n        while n >= v:\n            out += r\n            n -= v\n    return out",
        [1, 4, 9, 58, 1994, 3999],
    ),
    _p(
        "balanced_brackets",
        "def balanced_brackets(s: str) -> bool",
        "Return True if the brackets ()[]{} in s are balanced; ignore other characters.",
        "def balanced_brackets(s):\n    pairs = {')': '(', ']': '[', '}': '{'}\n    st = []\n    for c in s:\n        if c in '([{':\n            st.append(c)\n        elif c in pairs:\n            if not st or st.pop() != pairs[c]:\n                return False\n    return not st",
        ["", "()", "([]{})", "(]", "((", "a(b)c]", "{[()()]}"],
    ),
    _p(
        "binary_search",
        "def binary_search(xs: list[int], x: int) -> int",
        "Return the index of x in sorted xs, or -1 if absent.",
        "def binary_search(xs, x):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n        mid = (lo + hi) // 2\n        if xs[mid] == x:\n            return mid\n        if xs[mid] < x:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n    return -1",
        [([1, 3, 5, 7], 5), ([1, 3, 5, 7], 4), ([], 1), ([2], 2), (list(range(0, 1000, 3)), 999)],
    ),
    _p(
        "merge_sorted",
        "def merge_sorted(a: list[int], b: list[int]) -> list[int]",
        "Merge two sorted lists into one sorted list.",
        "def merge_sorted(a, b):\n    return sorted(a + b)",
        [([1, 4], [2, 3]), ([], [1]), ([], []), ([1, 1], [1])],
    ),
    _p(
        "transpose",
        "def transpose(m: list[list[int]]) -> list[list[int]]",
        "Transpose a rectangular matrix (list of rows).",
        "def transpose(m):\n    return [list(r) for r in zip(*m)]",
        [([[1, 2], [3, 4]],), ([[1, 2, 3]],), ([],), ([[1], [2]],)],
    ),
    _p(
        "matrix_multiply",
        "def matrix_multiply(a: list[list[int]], b: list[list[int]]) -> list[list[int]]",
        "Multiply matrices a (n x k) and b (k x m).",
        "def matrix_multiply(a, b):\n    return [[sum(x * y for x, y in zip(r, c)) for c in zip(*b)] for r in a]",
        [([[1, 2], [3, 4]], [[5, 6], [7, 8]]), ([[1, 0, 2]], [[1], [2], [3]]), ([[2]], [[3]])],
    ),
    _p(
        "count_islands",
        "def count_islands(grid: list[str]) -> int",
        "Count 4-connected groups of '#' cells in a grid given as equal-length strings.",
        "def count_islands(grid):\n    seen = set()\n    n = 0\n    for i, row in enumerate(grid):\n        for j, c in enumerate(row):\n            if c == '#' and (i, j) not in seen:\n                n += 1\n                stack = [(i, j)]\n                seen.add((i, j))\n                while stack:\n                    y, x = stack.pop()\n                    for dy, dx in ((1, 0), (-1, 0), (0, 1), (0, -1)):\n                        a, b = y + dy, x + dx\n                        if 0 <= a < len(grid) and 0 <= b < len(grid[a]) and grid[a][b] == '#' and (a, b) not in seen:\n                            seen.add((a, b))\n                            stack.append((a, b))\n    return n",
        [([],), (["#"],), (["#.#", ".#.", "#.#"],), (["##", "##"],), (["#..#", "#..#", "####"],)],
    ),
    _p(
        "longest_common_prefix",
        "def longest_common_prefix(words: list[str]) -> str",
        "Return the longest common prefix of the words ('' for an empty list).",
        "def longest_common_prefix(words):\n    if not words:\n        return ''\n    p = words[0]\n    for w in words[1:]:\n        while not w.startswith(p):\n            p = p[:-1]\n    return p",
        [
            ([],),
            (["flower", "flow", "flight"],),
            (["a"],),
            (["dog", "racecar"],),
            (["same", "same"],),
        ],
    ),
    _p(
        "run_length_encode",
        "def run_length_encode(s: str) -> str",
        "Encode runs as count followed by character, e.g. 'aaab' -> '3a1b'.",
        "def run_length_encode(s):\n    out = []\n    i = 0\n    while i < len(s):\n        j = i\n        while j < len(s) and s[j] == s[i]:\n            j += 1\n        out.append(f'{j - i}{s[i]}')\n        i = j\n    return ''.join(out)",
        ["", "a", "aaab", "abc", "zzzzzzzzzzzz"],
    ),
    _p(
        "two_sum",
        "def two_sum(xs: list[int], target: int) -> list[int]",
        "Return [i, j] with i < j and xs[i] + xs[j] == target, the lexicographically smallest such pair, or [] if none.",
        "def two_sum(xs, target):\n    for i in range(len(xs)):\n        for j in range(i + 1, len(xs)):\n            if xs[i] + xs[j] == target:\n                return [i, j]\n    return []",
        [([2, 7, 11, 15], 9), ([3, 2, 4], 6), ([1, 2], 5), ([0, 0, 0], 0), ([], 1)],
    ),
    _p(
        "max_subarray",
        "def max_subarray(xs: list[int]) -> int",
        "Return the maximum sum of a non-empty contiguous subarray.",
        "def max_subarray(xs):\n    best = cur = xs[0]\n    for x in xs[1:]:\n        cur = max(x, cur + x)\n        best = max(best, cur)\n    return best",
        [([1],), ([-2, 1, -3, 4, -1, 2, 1, -5, 4],), ([-3, -1, -2],), ([5, 4, -1, 7, 8],)],
    ),
    _p(
        "pascal_row",
        "def pascal_row(n: int) -> list[int]",
        "Return row n (0-based) of Pascal's triangle.",
        "def pascal_row(n):\n    row = [1]\n    for _ in range(n):\n        row = [a + b for a, b in zip([0] + row, row + [0])]\n    return row",
        [0, 1, 4, 10],
    ),
    _p(
        "collatz_steps",
        "def collatz_steps(n: int) -> int",
        "Number of Collatz steps to reach 1 from n >= 1.",
        "def collatz_steps(n):\n    s = 0\n    while n != 1:\n        n = n // 2 if n % 2 == 0 else 3 * n + 1\n        s += 1\n    return s",
        [1, 2, 3, 27, 97],
    ),
    _p(
        "power_mod",
        "def power_mod(b: int, e: int, m: int) -> int",
        "Return b**e mod m for e >= 0, m >= 1.",
        "def power_mod(b, e, m):\n    return pow(b, e, m)",
        [(2, 10, 1000), (3, 0, 7), (10, 100, 13), (5, 3, 1), (7, 12345, 1000003)],
    ),
    _p(
        "integer_sqrt",
        "def integer_sqrt(n: int) -> int",
        "Return floor(sqrt(n)) for n >= 0, exactly, even for huge n.",
        "def integer_sqrt(n):\n    import math\n    return math.isqrt(n)",
        [0, 1, 15, 16, 10**30 + 7],
    ),
    _p(
        "dedupe_keep_order",
        "def dedupe_keep_order(xs: list) -> list",
        "Remove duplicates, keeping the first occurrence of each element.",
        "def dedupe_keep_order(xs):\n    seen = set()\n    out = []\n    for x in xs:\n        if x not in seen:\n            seen.add(x)\n            out.append(x)\n    return out",
        [([],), ([1, 2, 1, 3, 2],), (["b", "a", "b"],), ([4, 4, 4],)],
    ),
    _p(
        "word_lengths",
        "def word_lengths(s: str) -> list[int]",
        "Return the lengths of the whitespace-separated words of s.",
        "def word_lengths(s):\n    return [len(w) for w in s.split()]",
        ["", "a bb ccc", "  hello   world "],
    ),
    _p(
        "snake_to_camel",
        "def snake_to_camel(s: str) -> str",
        "Convert snake_case to camelCase (first word lower-case, skip empty parts).",
        "def snake_to_camel(s):\n    parts = [p for p in s.split('_') if p]\n    if not parts:\n        return ''\n    return parts[0].lower() + ''.join(p[:1].upper() + p[1:].lower() for p in parts[1:])",
        ["hello_world", "a", "", "__double__under", "already_Mixed_CASE"],
    ),
    _p(
        "count_bits",
        "def count_bits(n: int) -> int",
        "Return the number of 1 bits in n >= 0.",
        "def count_bits(n):\n    return bin(n).count('1')",
        [0, 1, 7, 8, 2**64 - 1],
    ),
    _p(
        "nth_triangular",
        "def nth_triangular(n: int) -> int",
        "Return 1 + 2 + ... + n for n >= 0.",
        "def nth_triangular(n):\n    return n * (n + 1) // 2",
        [0, 1, 4, 100, 10**9],
    ),
    _p(
        "median",
        "def median(xs: list[int]) -> float",
        "Return the median of a non-empty list as a float.",
        "def median(xs):\n    s = sorted(xs)\n    n = len(s)\n    return float(s[n // 2]) if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2",
        [([3],), ([1, 2],), ([5, 1, 3],), ([4, 1, 3, 2],), ([-1, -1, 7, 100],)],
    ),
    _p(
        "interleave",
        "def interleave(a: list, b: list) -> list",
        "Alternate elements of a and b, then append what remains of the longer.",
        "def interleave(a, b):\n    out = []\n    for i in range(max(len(a), len(b))):\n        if i < len(a):\n            out.append(a[i])\n        if i < len(b):\n            out.append(b[i])\n    return out",
        [([1, 2, 3], ["a", "b"]), ([], [1]), ([1], []), ([1, 2], [3, 4])],
    ),
    _p(
        "group_anagrams",
        "def group_anagrams(words: list[str]) -> list[list[str]]",
        "Group words that are anagrams; each group keeps input order, groups are ordered by their first word's position.",
        "def group_anagrams(words):\n    groups = {}\n    for w in words:\n        groups.setdefault(''.join(sorted(w)), []).append(w)\n    return list(groups.values())",
        [([],), (["eat", "tea", "tan", "ate", "nat", "bat"],), (["a"],), (["ab", "ba", "ab"],)],
    ),
]

assert len({p.name for p in PROBLEMS}) == len(PROBLEMS), "duplicate code problem names"
