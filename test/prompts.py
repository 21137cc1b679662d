"""Fixed prompts for exactness tests: chat, code and JSON tool calls (ChatML messages)."""

CHAT = [
    "Explain in three sentences why the sky is blue.",
    "Give me a short packing list for a weekend hiking trip.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn rain.",
]
CODE = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function `is_palindrome(s)` that ignores case and spaces, with a docstring.",
    "Write a JavaScript function that debounces another function.",
    "Write a SQL query that returns the five customers with the highest total order value.",
]
TOOL_SYSTEM = (
    "You are an assistant that calls tools. Answer ONLY with a JSON object of the form "
    '{"tool": NAME, "arguments": {...}}. Tools: get_weather(city: string, unit: "C"|"F"), '
    "search_flights(origin: string, destination: string, date: string), "
    "create_event(title: string, start: string, duration_minutes: integer)."
)
TOOL = [
    "What's the weather in Paris in Celsius?",
    "Find me flights from Boston to Denver on 2026-12-03.",
    "Put a 30 minute meeting called 'Design review' on my calendar at 2026-12-01T15:00.",
    "Is it cold in Oslo right now? Use Fahrenheit.",
]


def messages(category: str, text: str) -> list[dict]:
    if category == "tool":
        return [{"role": "system", "content": TOOL_SYSTEM}, {"role": "user", "content": text}]
    return [{"role": "user", "content": text}]


def prompt_set(n_per_category: int) -> list[tuple[str, list[dict]]]:
    """(name, messages) pairs, ``n_per_category`` from each category."""
    out = []
    for category, texts in (("chat", CHAT), ("code", CODE), ("tool", TOOL)):
        for i, text in enumerate(texts[:n_per_category]):
            out.append((f"{category}{i}", messages(category, text)))
    return out
