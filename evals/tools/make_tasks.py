#!/usr/bin/env python3
"""Build quantkit's own lm-evaluation-harness tasks.

Every item below was written for quantkit (hand-written lists) or is generated
here from a fixed seed; nothing is taken from an existing benchmark.

    python evals/tools/make_tasks.py           # (re)write evals/data/*.jsonl and evals/tasks/*.yaml
    python evals/tools/make_tasks.py --check   # fail if the committed files differ from what this script makes

Only the Python standard library is used. The output is byte-for-byte
deterministic, so ``--check`` can run in CI.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

EVALS = Path(__file__).resolve().parent.parent
DATA_DIR = EVALS / "data"
TASK_DIR = EVALS / "tasks"
# data_files paths written into the task YAMLs: relative to the repository root,
# because lm-eval 0.4.13 hands them to datasets.load_dataset unchanged and
# datasets resolves relative paths against the current working directory.
DATA_REL = "evals/data"

SEED = 20240611

# --------------------------------------------------------------------------
# qk_cloze: everyday sentence completion, hand-written.
# (context, right ending, wrong ending, wrong ending, wrong ending)
# --------------------------------------------------------------------------
CLOZE = [
    ("She put the ice cream in the", "freezer", "oven", "bathtub", "mailbox"),
    ("He brushed his teeth with a", "toothbrush", "hammer", "fork", "shoe"),
    ("It was raining, so she opened her", "umbrella", "refrigerator", "dictionary", "piano"),
    ("The baby was tired, so his mother put him in his", "crib", "oven", "sink", "mailbox"),
    ("To cut the bread, he used a", "knife", "pillow", "sock", "balloon"),
    ("The happy dog wagged its", "tail", "book", "wheel", "window"),
    ("We bought milk and eggs at the", "store", "ocean", "moon", "volcano"),
    ("He was thirsty, so he drank a glass of", "water", "sand", "paper", "glue"),
    ("At night, we sleep in a", "bed", "bucket", "teapot", "drawer"),
    ("She wrote a letter with a", "pen", "banana", "spoon", "brick"),
    ("The little fish swims in the", "water", "oven", "sky", "closet"),
    ("Birds can fly because they have", "wings", "wheels", "pockets", "teeth"),
    ("He put on his shoes and tied the", "laces", "clouds", "dishes", "windows"),
    ("I wear a warm coat when it is", "cold", "hungry", "purple", "loud"),
    ("The cat chased the", "mouse", "mountain", "piano", "river"),
    ("She turned on the light because the room was", "dark", "salty", "hungry", "square"),
    ("To open the locked door, he used a", "key", "carrot", "pillow", "cup"),
    ("The teacher wrote the lesson on the", "board", "soup", "dog", "rain"),
    ("After dinner, he washed the", "dishes", "clouds", "sun", "music"),
    ("Every morning the farmer milked the", "cow", "tractor", "fence", "cloud"),
    ("He was sleepy, so he went to", "bed", "sand", "lunch", "paint"),
    ("The car was almost empty, so she drove to the", "gas station", "library", "zoo", "bakery"),
    ("When you are sick, you should see a", "doctor", "plumber", "clown", "pilot"),
    ("The children built a snowman in the", "winter", "summer", "desert", "oven"),
    ("Before bed, he likes to read a", "book", "soup", "chair", "rainbow"),
    ("To grow, a plant needs sunlight and", "water", "plastic", "shoes", "metal"),
    ("She listened to music with her", "headphones", "gloves", "spoons", "socks"),
    ("The bread was baked in the", "oven", "freezer", "bathtub", "garden"),
    ("He paid for the groceries with", "money", "leaves", "sand", "snow"),
    ("The small boat sailed across the", "lake", "sky", "forest", "road"),
    ("The busy bee makes", "honey", "bread", "cheese", "paper"),
    ("The hen laid an", "egg", "apple", "orange", "umbrella"),
    ("The clock on the wall shows the", "time", "smell", "taste", "price"),
    ("In front of the mirror, he combed his", "hair", "shoes", "soup", "car"),
    ("To read at night, she turned on a", "lamp", "faucet", "blender", "fan"),
    ("The train stopped at the", "station", "ocean", "moon", "sandwich"),
    ("After the long run, she was very", "tired", "blue", "square", "wooden"),
    ("The ice melted because it was", "warm", "cold", "quiet", "square"),
    ("After his shower, he dried himself with a", "towel", "spoon", "book", "candle"),
    ("She sent the birthday card by", "mail", "spoon", "tree", "soup"),
    ("The kids played soccer in the", "park", "refrigerator", "bathtub", "oven"),
    ("A pilot flies an", "airplane", "egg", "onion", "oven"),
    ("The cook stirred the soup with a", "spoon", "shoe", "pillow", "book"),
    ("The mail carrier put the letter in the", "mailbox", "oven", "toilet", "aquarium"),
    ("He cut the grass with a", "lawn mower", "toothbrush", "spoon", "pencil"),
    ("At the library you can borrow", "books", "cars", "cows", "rain"),
    ("We keep our clothes in a", "closet", "freezer", "toaster", "fishbowl"),
    ("She put a stamp on the", "envelope", "cat", "soup", "moon"),
    ("The firefighters quickly put out the", "fire", "moon", "soup", "music"),
    ("In the garden, he watered the", "flowers", "radio", "books", "spoons"),
    ("In the morning, she drinks a cup of", "coffee", "sand", "nails", "paint"),
    ("The dentist looked at her", "teeth", "car", "roof", "garden"),
    ("The bird built a nest in the", "tree", "oven", "sink", "pocket"),
    ("The glass fell on the floor and", "broke", "sang", "grew", "laughed"),
    ("She wears glasses to help her", "see", "cook", "sleep", "swim"),
    ("The baby drank milk from a", "bottle", "shoe", "hat", "drawer"),
    ("Snow is white and", "cold", "hot", "sweet", "loud"),
    ("Lemons taste very", "sour", "loud", "square", "tall"),
    ("At the store, he put the groceries in a", "bag", "sky", "river", "chimney"),
    ("The soldier saluted the", "flag", "sandwich", "cloud", "pillow"),
    ("Before leaving, he locked the door with a", "key", "banana", "sock", "cookie"),
    ("The students sat down at their", "desks", "clouds", "rivers", "ovens"),
    ("We went to the beach to swim in the", "ocean", "library", "oven", "closet"),
    ("For his cough, the doctor gave him some", "medicine", "bricks", "nails", "gasoline"),
    ("You can buy fresh bread at the", "bakery", "dentist", "jail", "garage"),
    ("The kitten drank a bowl of", "milk", "sand", "nails", "glue"),
    ("She wiped the dirty table with a", "cloth", "hammer", "candle", "book"),
    ("On the field, the boy kicked the", "ball", "sky", "moon", "sun"),
    ("She hung the picture on the", "wall", "soup", "river", "cloud"),
    ("The tired runner sat down on a", "bench", "cloud", "wave", "needle"),
    ("We eat soup with a", "spoon", "comb", "brush", "key"),
    ("The alarm clock woke him up early in the", "morning", "bathtub", "garden", "library"),
    ("He blew out the candles on his birthday", "cake", "shoe", "car", "pillow"),
    ("She put on sunscreen before going to the", "beach", "basement", "cellar", "closet"),
    ("In the meadow, the cows eat", "grass", "rocks", "metal", "glass"),
    ("The painter painted the", "wall", "soup", "wind", "music"),
    ("Fish breathe through their", "gills", "elbows", "knees", "hair"),
    ("The police stopped the car because it was going too", "fast", "green", "quiet", "round"),
    ("The ice cube melted in the hot", "sun", "freezer", "snow", "fridge"),
    ("For breakfast, she poured cereal into a", "bowl", "shoe", "hat", "letter"),
    ("At the end of the show, we clapped our", "hands", "ears", "noses", "knees"),
    ("He smelled the roses with his", "nose", "elbow", "knee", "foot"),
    ("She heard the music with her", "ears", "feet", "elbows", "teeth"),
    ("The library is a quiet place to", "read", "shout", "swim", "cook"),
    ("In autumn, the trees lose their", "leaves", "wheels", "teeth", "windows"),
    ("When water boils, it is very", "hot", "cold", "blue", "slow"),
    ("In the corner, the spider spun a", "web", "cake", "sweater", "car"),
    ("He caught a fish with his fishing", "rod", "hat", "spoon", "book"),
    ("The music was too loud, so she covered her", "ears", "feet", "knees", "elbows"),
    ("To call his friend, he picked up his", "phone", "sandwich", "shoe", "pillow"),
    ("The pizza was delivered to our", "house", "moon", "ocean", "cloud"),
    ("The little girl hugged her teddy", "bear", "car", "knife", "lamp"),
    ("The rooster crows early in the", "morning", "soup", "ocean", "drawer"),
    ("The mechanic fixed the broken", "car", "cloud", "soup", "river"),
    ("He planted the seeds in the", "garden", "freezer", "microwave", "bathtub"),
    ("She typed the report on her", "computer", "pillow", "sandwich", "shoe"),
    ("The lion is a big wild", "cat", "fish", "bird", "tree"),
    ("We use an umbrella to stay", "dry", "hungry", "loud", "tall"),
    ("Scissors are used to cut", "paper", "soup", "music", "smoke"),
    ("The winner of the race got a gold", "medal", "potato", "sock", "spoon"),
    ("After breakfast, he put the milk back in the", "fridge", "oven", "closet", "mailbox"),
    ("She washed her hands with soap and", "water", "sand", "glue", "honey"),
    ("The baker made a loaf of", "bread", "bricks", "rocks", "glass"),
    ("He tied the boat to the", "dock", "cloud", "star", "rainbow"),
    ("The nurse took his", "temperature", "car", "house", "bicycle"),
    ("The kids built a sandcastle on the", "beach", "roof", "bus", "moon"),
    ("The elephant picked up the peanut with its long", "trunk", "wing", "beak", "pocket"),
    ("The chef chopped the onions and began to", "cry", "fly", "melt", "bark"),
    ("He swept the floor with a", "broom", "fork", "pillow", "sock"),
    ("At the zoo, we saw a very tall", "giraffe", "teaspoon", "mushroom", "button"),
    ("At the bus stop, the driver opened the", "doors", "ocean", "sky", "soup"),
    ("She folded the letter and put it in an", "envelope", "onion", "egg", "ocean"),
    ("The old ship sank to the bottom of the", "sea", "sky", "tree", "hill"),
    ("The students raised their hands to ask a", "question", "sandwich", "tree", "river"),
    ("The puppy was hungry, so she gave it some", "food", "rocks", "books", "paint"),
    ("In the rocket, the astronaut flew to the", "moon", "bakery", "bathtub", "closet"),
    ("He hammered the nail into the", "wood", "water", "soup", "air"),
    ("On cold days, she wears gloves on her", "hands", "feet", "ears", "nose"),
    ("He was late, so he ran to catch the", "bus", "moon", "soup", "cloud"),
    ("The pan was hot, so she used an oven", "mitt", "boot", "sock", "helmet"),
    ("To get his kite back, the boy climbed the", "tree", "soup", "cloud", "river"),
    ("At the restaurant, the waiter brought us the", "menu", "moon", "river", "tree"),
    ("The farmer sheared the sheep for their", "wool", "bricks", "glass", "oil"),
    ("The camel walked across the hot", "desert", "ocean", "ceiling", "mirror"),
    ("She looked at herself in the", "mirror", "soup", "oven", "tree"),
    ("The farmer grew corn in his", "field", "bathtub", "car", "pocket"),
    ("To keep the room warm, he put a log on the", "fire", "cloud", "soup", "bed"),
    ("Ice cream tastes", "sweet", "loud", "square", "sharp"),
    ("The thief was caught by the", "police", "clouds", "flowers", "spoons"),
    ("She turned off the TV and went to", "sleep", "melt", "bark", "rain"),
    ("The carpenter built a wooden", "table", "soup", "cloud", "river"),
    ("He saved his money in the", "bank", "oven", "soup", "river"),
    ("The goalkeeper jumped and caught the", "ball", "house", "tree", "bus"),
    ("When the traffic light turned green, the cars began to", "move", "sing", "melt", "sleep"),
    ("The little mouse was afraid of the", "cat", "cheese", "carpet", "spoon"),
    ("She fixed the torn shirt with a needle and", "thread", "soup", "sand", "butter"),
    ("The runner crossed the finish", "line", "soup", "cloud", "tree"),
    ("At the restaurant, he ordered a", "pizza", "bicycle", "lamp", "window"),
    ("He opened the window to let in some fresh", "air", "soup", "bricks", "shoes"),
    ("Every morning, the newspaper is left at our", "door", "oven", "ocean", "moon"),
    ("The tea was too hot to drink, so she let it", "cool", "sing", "fly", "swim"),
    ("The bride wore a long white", "dress", "tire", "fence", "bucket"),
    ("He put the letter in the envelope and licked the", "stamp", "tiger", "ladder", "pillow"),
    ("At the party, the children popped the", "balloons", "houses", "rivers", "mountains"),
    ("The wet clothes were hung outside to", "dry", "sing", "melt", "bark"),
]

# --------------------------------------------------------------------------
# qk_facts: very easy knowledge and pattern questions, hand-written lists.
# Distractors are drawn (seeded) from the same category, so the options always
# look like answers of the right kind.
# --------------------------------------------------------------------------
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July",
          "August", "September", "October", "November", "December"]
OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("day", "night"),
    ("fast", "slow"), ("happy", "sad"), ("open", "closed"), ("wet", "dry"),
    ("light", "dark"), ("full", "empty"), ("hard", "soft"), ("early", "late"),
    ("left", "right"), ("loud", "quiet"), ("strong", "weak"), ("tall", "short"),
    ("thick", "thin"), ("rich", "poor"), ("clean", "dirty"), ("inside", "outside"),
    ("push", "pull"), ("win", "lose"), ("true", "false"), ("always", "never"),
    ("first", "last"), ("buy", "sell"), ("give", "take"), ("asleep", "awake"),
]
# words that must not be offered as a wrong answer for a given word (too close to right)
OPPOSITE_CLASH = {"day": {"dark"}, "light": {"night"}, "early": {"last"}, "first": {"late"}}
PLURALS = [
    ("child", "children", ["childs", "childes"]),
    ("mouse", "mice", ["mouses", "mousen"]),
    ("foot", "feet", ["foots", "footes"]),
    ("tooth", "teeth", ["tooths", "toothes"]),
    ("man", "men", ["mans", "manes"]),
    ("woman", "women", ["womans", "womanes"]),
    ("goose", "geese", ["gooses", "goosen"]),
    ("person", "people", ["persones", "peoplen"]),
    ("cat", "cats", ["cates", "caten"]),
    ("dog", "dogs", ["doges", "dogen"]),
    ("box", "boxes", ["boxs", "boxen"]),
    ("baby", "babies", ["babys", "babyes"]),
    ("leaf", "leaves", ["leafs", "leafes"]),
    ("knife", "knives", ["knifes", "knifen"]),
    ("bus", "buses", ["bus", "busen"]),
    ("apple", "apples", ["applees", "applen"]),
    ("wolf", "wolves", ["wolfs", "wolfes"]),
    ("city", "cities", ["citys", "cityes"]),
    ("book", "books", ["bookes", "booken"]),
    ("house", "houses", ["housen", "hice"]),
]
ANIMAL_SOUNDS = [
    ("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack"),
    ("sheep", "baa"), ("pig", "oink"), ("lion", "roar"), ("snake", "hiss"),
    ("bee", "buzz"), ("owl", "hoot"), ("horse", "neigh"), ("frog", "ribbit"),
    ("mouse", "squeak"), ("rooster", "cock-a-doodle-doo"), ("donkey", "hee-haw"),
    ("crow", "caw"),
]
COLOURS_POOL = ["red", "blue", "green", "yellow", "white", "black", "orange", "brown", "pink", "purple"]
# (thing, colour, colours that must not be offered as wrong answers)
COLOURS = [
    ("the sky on a clear sunny day", "blue", ()), ("fresh grass", "green", ()),
    ("fresh snow", "white", ()), ("a ripe banana", "yellow", ("green", "brown")),
    ("coal", "black", ()), ("a ripe strawberry", "red", ("pink",)), ("milk", "white", ()),
    ("a carrot", "orange", ()), ("a lemon", "yellow", ("green",)),
    ("milk chocolate", "brown", ("white", "black")), ("a ripe tomato", "red", ("green",)),
    ("a crow", "black", ()), ("a polar bear", "white", ()), ("broccoli", "green", ()),
    ("a fire truck", "red", ("yellow",)), ("a pumpkin", "orange", ("yellow",)),
    ("a lime", "green", ("yellow",)), ("the trunk of a tree", "brown", ("black",)),
]
CAPITALS = [
    ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Germany", "Berlin"),
    ("Spain", "Madrid"), ("England", "London"), ("Russia", "Moscow"), ("China", "Beijing"),
    ("Egypt", "Cairo"), ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Ireland", "Dublin"),
    ("Austria", "Vienna"), ("South Korea", "Seoul"), ("Thailand", "Bangkok"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Poland", "Warsaw"),
    ("Argentina", "Buenos Aires"), ("Cuba", "Havana"),
]
CATEGORIES = {
    "fruit": ["apple", "banana", "pear", "cherry", "grape"],
    "animal": ["horse", "rabbit", "tiger", "zebra", "monkey"],
    "vegetable": ["carrot", "potato", "onion", "cabbage", "pea"],
    "piece of furniture": ["chair", "sofa", "table", "wardrobe", "bookshelf"],
    "tool": ["hammer", "screwdriver", "saw", "wrench", "shovel"],
    "vehicle": ["car", "bus", "truck", "bicycle", "train"],
    "piece of clothing": ["shirt", "jacket", "sweater", "skirt", "scarf"],
}
SIMPLE_FACTS = [
    # (question, answer, distractors)
    ("How many legs does a dog have?", "four", ["two", "six", "ten"]),
    ("How many legs does a chicken have?", "two", ["four", "six", "eight"]),
    ("How many days are there in a week?", "seven", ["three", "ten", "twelve"]),
    ("How many months are there in a year?", "twelve", ["seven", "four", "thirty"]),
    ("How many sides does a triangle have?", "three", ["four", "six", "eight"]),
    ("How many sides does a square have?", "four", ["three", "five", "nine"]),
    ("What is frozen water called?", "ice", ["sand", "smoke", "wood"]),
    ("What do cows give us to drink?", "milk", ["oil", "ink", "juice"]),
    ("What do you call a baby dog?", "a puppy", ["a kitten", "a calf", "a chick"]),
    ("What do you call a baby cat?", "a kitten", ["a puppy", "a lamb", "a foal"]),
    ("Which season comes after winter?", "spring", ["autumn", "summer", "midnight"]),
    ("What is the first letter of the English alphabet?", "A", ["M", "Q", "Z"]),
    ("Which letter comes after B?", "C", ["A", "K", "T"]),
    ("Which body part do we use to see?", "eyes", ["ears", "knees", "elbows"]),
    ("Which body part do we use to hear?", "ears", ["eyes", "toes", "elbows"]),
    ("What falls from the clouds when it rains?", "water", ["sand", "coins", "leaves"]),
    ("Where do fish live?", "in water", ["in trees", "in the sky", "in the desert"]),
    ("What do we call the star that shines in the sky during the day?", "the sun", ["the moon", "a cloud", "a comet"]),
]

# --------------------------------------------------------------------------
# qk_arith: tiny arithmetic, generated. Fixed demonstrations go in the prompt
# and are excluded from the test items.
# --------------------------------------------------------------------------
ARITH_DEMOS = [("+", 2, 3), ("-", 9, 7), ("+", 6, 3)]

# --------------------------------------------------------------------------
# qk_copy: repeat a short list of common words, generated.
# --------------------------------------------------------------------------
COPY_WORDS = [
    "apple", "river", "chair", "green", "house", "bread", "cloud", "dog", "table",
    "music", "lamp", "stone", "shoe", "milk", "tree", "window", "paper", "horse",
    "glass", "train", "garden", "pencil", "orange", "blue", "coat", "sugar",
    "bottle", "rain", "cake", "door", "bird", "candle", "map", "spoon", "tiger",
    "water", "wheel", "hat", "bridge", "sun", "boat", "clock", "ring", "flower",
    "egg", "salt", "moon", "road", "box", "king", "ball", "fish", "cup", "star",
    "book", "leaf", "snow", "bell", "key", "farm",
]
COPY_DEMOS = [["red", "cat", "sun"], ["pen", "cup", "tree", "bag"], ["hand", "rice", "yellow", "fox", "mat"]]


# --------------------------------------------------------------------------
def _mc(rng: random.Random, right: str, wrong: list[str]) -> tuple[list[str], int]:
    """Shuffle the right answer in among the wrong ones; return (choices, label)."""
    assert right not in wrong and len(set(wrong)) == len(wrong), (right, wrong)
    choices = [right] + list(wrong)
    rng.shuffle(choices)
    return choices, choices.index(right)


def build_cloze(rng: random.Random) -> list[dict]:
    items = []
    for i, (context, right, *wrong) in enumerate(CLOZE, 1):
        choices, label = _mc(rng, right, wrong)
        items.append({"id": f"cloze-{i:03d}", "context": context, "choices": choices, "label": label})
    return items


def build_facts(rng: random.Random) -> list[dict]:
    raw: list[tuple[str, str, str, list[str]]] = []  # (category, question, right, wrong)

    def pick(pool: list[str], right: str, k: int = 3, exclude: tuple[str, ...] = ()) -> list[str]:
        cands = sorted({p for p in pool if p != right and p not in exclude})
        return rng.sample(cands, k)

    for i, d in enumerate(DAYS):
        nxt = DAYS[(i + 1) % 7]
        raw.append(("days", f"Which day comes after {d}?", nxt, pick(DAYS, nxt, exclude=(d,))))
    for i, d in enumerate(DAYS[1:6], 1):
        prev = DAYS[i - 1]
        raw.append(("days", f"Which day comes before {d}?", prev, pick(DAYS, prev, exclude=(d,))))
    for i, m in enumerate(MONTHS):
        nxt = MONTHS[(i + 1) % 12]
        raw.append(("months", f"Which month comes after {m}?", nxt, pick(MONTHS, nxt, exclude=(m,))))
    for n in (3, 7, 9, 12, 15, 19, 20, 24, 31, 48):
        right = str(n + 1)
        near = sorted({x for x in (n - 1, n - 3, n + 3, n + 5, n + 10, n * 2) if x > 0 and x != n + 1})
        wrong = [str(x) for x in rng.sample(near, 3)]
        raw.append(("counting", f"What number comes after {n}?", right, wrong))
    all_opposite_words = [w for pair in OPPOSITES for w in pair]
    for word, opp in OPPOSITES:
        raw.append(("opposites", f"What is the opposite of {word}?", opp,
                    pick(all_opposite_words, opp, exclude=(word, *OPPOSITE_CLASH.get(word, ())))))
    all_plurals = [p for _, p, _ in PLURALS]
    for word, plural, bad_forms in PLURALS:
        wrong = bad_forms + pick(all_plurals, plural, k=1, exclude=tuple(bad_forms))
        raw.append(("plurals", f"What is the plural of the word {word}?", plural, wrong))
    all_sounds = [s for _, s in ANIMAL_SOUNDS]
    for animal, sound in ANIMAL_SOUNDS:
        article = "an" if animal[0] in "aeiou" else "a"
        raw.append(("animal_sounds", f"What sound does {article} {animal} make?", sound, pick(all_sounds, sound)))
    for thing, colour, clash in COLOURS:
        raw.append(("colours", f"What color is {thing}?", colour, pick(COLOURS_POOL, colour, exclude=clash)))
    all_capitals = [c for _, c in CAPITALS]
    for country, capital in CAPITALS:
        raw.append(("capitals", f"What is the capital city of {country}?", capital, pick(all_capitals, capital)))
    for cat in sorted(CATEGORIES):
        others = [w for c, ws in CATEGORIES.items() if c != cat for w in ws]
        article = "an" if cat[0] in "aeiou" else "a"
        forms = [f"Which of these is {article} {cat}?", f"Which one of these words names {article} {cat}?",
                 f"Pick the {cat}."]
        for member, q in zip(CATEGORIES[cat][:3], forms):
            raw.append(("categories", q, member, pick(others, member)))
    for q, a, wrong in SIMPLE_FACTS:
        raw.append(("simple_facts", q, a, list(wrong)))

    # categories interleaved (round-robin in first-seen order), so that the first N items (an eval's
    # task_limit) keep the mix of categories
    by_cat: dict[str, list] = {}
    for row in raw:
        by_cat.setdefault(row[0], []).append(row)
    queues = list(by_cat.values())
    raw = [q.pop(0) for _ in range(max(map(len, queues))) for q in queues if q]
    items = []
    for i, (cat, q, right, wrong) in enumerate(raw, 1):
        choices, label = _mc(rng, right, wrong)
        items.append({"id": f"facts-{i:03d}", "category": cat, "question": q, "choices": choices, "label": label})
    return items


def build_arith(rng: random.Random) -> list[dict]:
    demos = set(ARITH_DEMOS)
    adds = [("+", a, b) for a in range(1, 10) for b in range(1, 10) if ("+", a, b) not in demos]
    subs = [("-", a, b) for a in range(2, 13) for b in range(1, a) if ("-", a, b) not in demos]
    chosen = rng.sample(adds, 75) + rng.sample(subs, 55)
    rng.shuffle(chosen)
    items = []
    for i, (op, a, b) in enumerate(chosen, 1):
        ans = a + b if op == "+" else a - b
        items.append({"id": f"arith-{i:03d}", "op": op, "a": a, "b": b,
                      "question": f"What is {a} {op} {b}?", "answer": str(ans)})
    return items


def build_copy(rng: random.Random) -> list[dict]:
    seen = {", ".join(d) for d in COPY_DEMOS}
    items = []
    while len(items) < 120:
        n = rng.choice([3, 4, 4, 5, 5, 6])
        words = ", ".join(rng.sample(COPY_WORDS, n))
        if words in seen:
            continue
        seen.add(words)
        items.append({"id": f"copy-{len(items) + 1:03d}", "n_words": n, "words": words, "answer": words})
    return items


# --------------------------------------------------------------------------
def validate(tasks: dict[str, list[dict]]) -> None:
    for name, items in tasks.items():
        assert len(items) >= 100, (name, len(items))
        ids = [it["id"] for it in items]
        assert len(set(ids)) == len(ids), f"{name}: duplicate ids"
        key = {"qk_cloze": "context", "qk_facts": "question", "qk_arith": "question", "qk_copy": "words"}[name]
        keys = [it[key] for it in items]
        if name == "qk_facts":
            keys = [(it["question"], tuple(sorted(it["choices"]))) for it in items]
        dup = {k for k in keys if keys.count(k) > 1}
        assert not dup, f"{name}: duplicate items {sorted(dup)[:5]}"
        for it in items:
            if "choices" in it:
                ch = it["choices"]
                assert len(ch) == 4 and len(set(ch)) == 4, (name, it)
                assert 0 <= it["label"] < 4, (name, it)
                assert all(c == c.strip() and c for c in ch), (name, it)
    for it in tasks["qk_arith"]:
        a, b = it["a"], it["b"]
        expect = a + b if it["op"] == "+" else a - b
        assert it["answer"] == str(expect) and expect >= 0, it
        assert (it["op"], a, b) not in set(ARITH_DEMOS), it
    for it in tasks["qk_copy"]:
        assert it["answer"] == it["words"] and len(it["words"].split(", ")) == it["n_words"], it
    # answer position should be spread over A-D for the multiple-choice tasks
    for name in ("qk_cloze", "qk_facts"):
        counts = [sum(1 for it in tasks[name] if it["label"] == k) for k in range(4)]
        assert min(counts) >= len(tasks[name]) // 8, (name, counts)


# --------------------------------------------------------------------------
HEADER = "# Generated by evals/tools/make_tasks.py -- edit that script, not this file.\n"


def _q(s: str) -> str:
    """YAML double-quoted scalar (JSON strings are valid YAML)."""
    return json.dumps(s)


def _dataset_block(name: str) -> str:
    return (
        "dataset_path: json\n"
        "dataset_name: null\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {DATA_REL}/{name}.jsonl\n"
        "test_split: test\n"
    )


def yaml_texts() -> dict[str, str]:
    mc_metrics = (
        "metric_list:\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
    )
    out = {}
    out["qk_cloze"] = (
        HEADER + "task: qk_cloze\n" + _dataset_block("qk_cloze")
        + "output_type: multiple_choice\n"
        "doc_to_text: \"{{context}}\"\n"
        "doc_to_choice: choices\n"
        "doc_to_target: label\n"
        "target_delimiter: \" \"\n"
        "num_fewshot: 0\n"
        + mc_metrics + "metadata:\n  version: 1.0\n"
    )
    out["qk_facts"] = (
        HEADER + "task: qk_facts\n" + _dataset_block("qk_facts")
        + "output_type: multiple_choice\n"
        + "doc_to_text: " + _q("Question: {{question}}\nAnswer:") + "\n"
        "doc_to_choice: choices\n"
        "doc_to_target: label\n"
        "target_delimiter: \" \"\n"
        "num_fewshot: 0\n"
        + mc_metrics + "metadata:\n  version: 1.0\n"
    )
    demos = "".join(
        f"Question: What is {a} {op} {b}?\nAnswer: {a + b if op == '+' else a - b}\n\n" for op, a, b in ARITH_DEMOS
    )
    out["qk_arith"] = (
        HEADER + "task: qk_arith\n" + _dataset_block("qk_arith")
        + "output_type: generate_until\n"
        + "doc_to_text: " + _q(demos + "Question: {{question}}\nAnswer:") + "\n"
        "doc_to_target: answer\n"
        "num_fewshot: 0\n"
        "generation_kwargs:\n"
        "  until:\n    - \"\\n\"\n"
        "  max_gen_toks: 8\n"
        "  do_sample: false\n"
        "  temperature: 0.0\n"
        "filter_list:\n"
        "  - name: first-number\n"
        "    filter:\n"
        "      - function: regex\n"
        "        regex_pattern: \"(-?[0-9]+)\"\n"
        "        group_select: 0\n"
        "      - function: take_first\n"
        "metric_list:\n"
        "  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n"
    )
    copy_demos = "".join(f"Words: {', '.join(d)}\nCopy: {', '.join(d)}\n\n" for d in COPY_DEMOS)
    out["qk_copy"] = (
        HEADER + "task: qk_copy\n" + _dataset_block("qk_copy")
        + "output_type: generate_until\n"
        + "doc_to_text: " + _q("Copy the words exactly.\n\n" + copy_demos + "Words: {{words}}\nCopy:") + "\n"
        "doc_to_target: answer\n"
        "num_fewshot: 0\n"
        "generation_kwargs:\n"
        "  until:\n    - \"\\n\"\n"
        "  max_gen_toks: 32\n"
        "  do_sample: false\n"
        "  temperature: 0.0\n"
        "filter_list:\n"
        "  - name: strip\n"
        "    filter:\n"
        "      - function: remove_whitespace\n"
        "      - function: take_first\n"
        "metric_list:\n"
        "  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n"
    )
    out["qk_suite"] = (
        HEADER + "group: qk_suite\n"
        "task:\n  - qk_cloze\n  - qk_facts\n  - qk_arith\n  - qk_copy\n"
        "# No aggregate_metric_list: the tasks use different metrics (acc vs exact_match),\n"
        "# so each task is reported on its own.\n"
        "metadata:\n  version: 1.0\n"
    )
    return out


def render() -> dict[Path, str]:
    rng = random.Random(SEED)
    tasks = {
        "qk_cloze": build_cloze(rng),
        "qk_facts": build_facts(rng),
        "qk_arith": build_arith(rng),
        "qk_copy": build_copy(rng),
    }
    validate(tasks)
    files: dict[Path, str] = {}
    for name, items in tasks.items():
        files[DATA_DIR / f"{name}.jsonl"] = "".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items)
    for name, text in yaml_texts().items():
        files[TASK_DIR / f"{name}.yaml"] = text
    return files


def sync(files: dict[Path, str], check: bool, script: str) -> int:
    """Write `files`, or with `check` compare them with what is committed; print each data file's item count.
    Returns the exit status: 1 when `check` finds a file out of date."""
    stale = []
    for path, text in files.items():
        if check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    for path, text in files.items():
        if path.suffix == ".jsonl":
            print(f"{path.relative_to(EVALS.parent)}: {text.count(chr(10))} items")
    if stale:
        print(f"out of date (run python evals/tools/{script}):", *map(str, stale), sep="\n  ", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="verify the committed files instead of writing them")
    return sync(render(), ap.parse_args(argv).check, "make_tasks.py")


if __name__ == "__main__":
    sys.exit(main())
