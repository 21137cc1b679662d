"""Fixed prompts for exactness tests: chat, code and JSON tool calls (ChatML messages), 8 of
each (24 in all). New prompts go at the end of a list, so ``prompt_set(n)`` for a smaller n
(the CI subsets) keeps its prompts."""

CHAT = [
    "Explain in three sentences why the sky is blue.",
    "Give me a short packing list for a weekend hiking trip.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn rain.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do I politely decline a meeting invitation? Give an example email.",
    "List four tips for getting better sleep.",
    "Why do cats purr? Answer briefly.",
]
CODE = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function `is_palindrome(s)` that ignores case and spaces, with a docstring.",
    "Write a JavaScript function that debounces another function.",
    "Write a SQL query that returns the five customers with the highest total order value.",
    "Write a Python class `Stack` with push, pop and peek methods.",
    "Write a bash script that counts the lines of every .py file in a directory.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a C function that reverses a string in place.",
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
    "I need a flight from Seattle to Chicago on 2026-12-10.",
    "Schedule 'Lunch with Sam' for 2026-12-05T12:30, one hour.",
    "Tell me the temperature in Tokyo, in Celsius please.",
    "Book me onto a flight from Miami to New York on 2026-12-20.",
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
