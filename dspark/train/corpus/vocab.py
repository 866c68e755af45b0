"""Word lists the templates fill their slots from."""
from __future__ import annotations

NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jade", "Kofi", "Lena", "Mateo",
         "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Uma", "Victor", "Wen", "Yusuf", "Zoe", "Aiko",
         "Bruno", "Carmen", "Diego", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Keiko", "Liam", "Maya"]
ITEMS = ["apples", "books", "marbles", "stickers", "pencils", "cookies", "coins", "cards", "shells", "stamps",
         "oranges", "cupcakes", "toy cars", "flowers", "eggs", "bottles", "candles", "notebooks", "balloons", "beads"]
TOPICS = [
    "climate change", "the water cycle", "photosynthesis", "black holes", "the French Revolution", "the Roman Empire",
    "machine learning", "blockchain", "vaccines", "volcanoes", "plate tectonics", "the stock market", "inflation",
    "renewable energy", "electric cars", "the immune system", "sleep", "meditation", "remote work", "urban gardening",
    "coffee", "tea ceremonies", "jazz", "classical music", "the Olympic Games", "chess", "origami", "bread baking",
    "composting", "honeybees", "coral reefs", "the Moon landing", "the printing press", "the internet", "social media",
    "public libraries", "minimalism", "time management", "public speaking", "learning a new language", "budgeting",
    "first aid", "hiking safety", "bird watching", "astronomy for beginners", "the human heart", "DNA", "antibiotics",
    "recycling", "ocean tides", "rainbows", "earthquakes", "the Great Wall of China", "ancient Egypt", "the Renaissance",
    "the Industrial Revolution", "democracy", "supply and demand", "compound interest", "credit scores", "nutrition",
    "marathon training", "yoga", "video games", "board games", "film photography", "podcasts", "3D printing",
    "quantum computing", "cybersecurity", "password managers", "open-source software", "cloud computing", "robots",
    "self-driving cars", "space exploration", "Mars", "the solar system", "dinosaurs", "evolution", "rainforests",
    "deserts", "glaciers", "wind turbines", "nuclear power", "batteries", "smartphones", "the history of writing",
    "mythology", "fairy tales", "poetry", "theatre", "architecture", "bridges", "skyscrapers", "trains", "aviation",
    "sailing", "cooking pasta", "spices", "fermentation", "cheese making", "gardening in small spaces", "houseplants",
    "pets", "dog training", "cats", "horses", "volunteering", "friendship", "job interviews", "writing a resume",
    "negotiation", "leadership", "teamwork", "procrastination", "habits", "creativity", "critical thinking",
]
PLACES = ["Lisbon", "Kyoto", "Patagonia", "Iceland", "Marrakesh", "Vancouver", "the Scottish Highlands", "Istanbul",
          "New Zealand", "Vietnam", "Peru", "Norway", "Cape Town", "Prague", "Mexico City", "Seoul", "Tuscany"]
AUDIENCES = ["a ten-year-old", "a high-school student", "a busy manager", "a software engineer", "my grandmother",
             "a complete beginner", "a university student", "a new employee", "a tourist", "a small-business owner"]
TONES = ["formal", "friendly", "humorous", "persuasive", "upbeat", "calm", "concise", "poetic", "neutral"]
WRITING_FORMS = ["a short story", "a poem", "a haiku", "a limerick", "a blog post", "a product description",
                 "a formal letter", "a cover letter", "a speech", "a news article", "a diary entry", "a song verse",
                 "a dialogue between two friends", "a movie plot summary", "a restaurant review", "a travel guide entry",
                 "a motivational message", "a tweet thread", "an advertisement", "a short essay", "a fable",
                 "a recipe introduction", "a thank-you note", "a LinkedIn post", "a riddle"]
LANGUAGES = ["Python", "JavaScript", "TypeScript", "C", "C++", "Java", "Go", "Rust", "Ruby", "Bash", "SQL", "C#",
             "Kotlin", "Swift", "PHP", "Haskell", "Lua", "R"]
CODE_TASKS = [
    "reverses a string", "checks whether a string is a palindrome", "counts the vowels in a string",
    "returns the n-th Fibonacci number", "computes the factorial of a number", "checks whether a number is prime",
    "finds all prime numbers below n", "merges two sorted lists into one sorted list", "removes duplicates from a list "
    "while keeping the order", "finds the largest element in a list", "computes the average of a list of numbers",
    "sorts a list of words by length", "counts how often each word appears in a text", "flattens a nested list",
    "transposes a matrix", "multiplies two matrices", "converts Celsius to Fahrenheit",
    "converts a decimal number to binary", "checks whether two strings are anagrams", "implements binary search",
    "implements bubble sort", "implements quicksort", "implements a stack with push and pop",
    "implements a queue using two stacks", "finds the second smallest number in a list",
    "returns the longest common prefix of a list of strings", "validates an email address with a simple rule",
    "reads a CSV file and prints the sum of one column", "parses a date string and returns the weekday",
    "rotates a list by k positions", "computes the greatest common divisor of two numbers",
    "checks whether parentheses in a string are balanced", "counts the words in a sentence",
    "capitalizes the first letter of every word", "finds the intersection of two lists",
    "groups a list of words by their first letter", "computes the running total of a list",
    "returns the k most frequent elements", "checks whether a year is a leap year",
    "converts a Roman numeral to an integer", "converts an integer to a Roman numeral",
    "computes the digit sum of a number", "finds the missing number in a list from 1 to n",
    "implements a simple linked list", "reverses a linked list", "computes the depth of a binary tree",
    "implements breadth-first search on a graph", "implements depth-first search on a graph",
    "finds the shortest path in an unweighted graph", "implements a least-recently-used cache",
    "splits a list into chunks of size n", "computes the median of a list", "checks whether a list is sorted",
    "removes all whitespace from a string", "compresses a string with run-length encoding",
    "decodes a run-length encoded string", "generates all permutations of a list", "generates all subsets of a set",
    "computes the power set", "finds the maximum subarray sum", "counts the islands in a grid of 0s and 1s",
    "computes the edit distance between two strings", "finds the longest increasing subsequence",
    "validates a Sudoku board", "simulates rolling two dice 1000 times and prints the frequencies",
    "reads a text file and prints its ten most common words", "implements a simple bank account class",
    "implements a to-do list with add, remove and list operations", "computes simple interest",
    "converts a string to title case", "checks whether a number is a perfect square",
    "computes the area of a circle from its radius", "finds the mode of a list",
    "merges two dictionaries", "inverts a dictionary", "computes the dot product of two vectors",
]
BUGGY_SNIPPETS = [
    ("Python", "def average(xs):\n    return sum(xs) / len(xs) + 1"),
    ("Python", "def last(xs):\n    return xs[len(xs)]"),
    ("Python", "for i in range(10)\n    print(i)"),
    ("Python", "def add_item(item, items=[]):\n    items.append(item)\n    return items"),
    ("Python", "count = 0\ndef increment():\n    count += 1"),
    ("JavaScript", "function sum(arr) {\n  let total;\n  for (const x of arr) total += x;\n  return total;\n}"),
    ("JavaScript", "if (x = 5) {\n  console.log('five');\n}"),
    ("C", "int main() {\n  int a[5];\n  for (int i = 0; i <= 5; i++) a[i] = i;\n  return 0;\n}"),
    ("C", "char *copy(const char *s) {\n  char buf[64];\n  strcpy(buf, s);\n  return buf;\n}"),
    ("Java", "String a = \"hi\";\nString b = \"hi\";\nif (a == b) System.out.println(\"same\");"),
    ("SQL", "SELECT name, COUNT(*) FROM orders;"),
    ("Go", "func div(a, b int) int {\n    return a / b\n}"),
    ("Rust", "fn main() {\n    let v = vec![1, 2, 3];\n    let w = v;\n    println!(\"{:?}\", v);\n}"),
]
CONSTRAINTS = [
    "Answer in exactly three sentences.", "Use no more than 50 words.", "Use bullet points.",
    "Write it as a numbered list of five items.", "Do not use the letter 'e'.", "End with a question.",
    "Include the word 'lantern' twice.", "Write everything in lowercase.", "Start every sentence with the same word.",
    "Give your answer in JSON with the keys 'title' and 'summary'.", "Use a markdown table.",
    "Add a one-line summary at the end.", "Write two paragraphs separated by ***.", "Avoid any technical jargon.",
    "Include a title wrapped in double angular brackets, like <<title>>.", "Answer in the voice of a pirate.",
    "Keep it under 100 words.", "Use at least three examples.", "Respond with a short poem.",
    "Highlight at least two sections with markdown, like *highlighted section*.", "Finish with a P.S.",
    "Write the answer in all capital letters.", "Do not use any commas.", "Use exactly four bullet points.",
]
FOLLOW_UPS = [
    "Can you make it shorter?", "Now explain it to a child.", "Give me one more example.",
    "Rewrite your answer in a more formal tone.", "Summarize your answer in one sentence.",
    "What are the weaknesses of this approach?", "Turn your answer into a bulleted list.",
    "Translate the main idea into simpler words.", "Which part is the most important, and why?",
    "Give me a title for this.", "Can you make it funnier?", "What would an expert add to this?",
    "Rewrite it so that every sentence starts with a verb.", "Make it twice as long with more detail.",
    "What questions should I ask next?", "Check your answer for mistakes and fix any you find.",
    "Put the key facts in a table.",
]
CODE_FOLLOW_UPS = [
    "Can you add comments to the code?", "Now write tests for it.", "How would this change in a different language?",
    "Explain the time complexity.", "Now do the same for a list of strings.", "Can you make it faster?",
    "What edge cases does this miss?", "Rewrite it without using any libraries.", "Explain it line by line.",
]
MATH_FOLLOW_UPS = [
    "Check your work and give the final answer again.", "Can you solve it a different way?",
    "What if all the numbers were doubled?", "Explain the step you found hardest.", "Write a similar problem for me.",
]
