"""Write `models/data/corpus.txt`: short, simple English stories from a seeded grammar.

The built-in model is a ~1.4M-parameter byte-level DeepSeek-style model trained on a CPU in
minutes, so the corpus has to be small, regular and still read as English: a closed vocabulary
(names, animals, places, things, adjectives), fixed story shapes (an opening, a trip, a meeting,
a bit of dialogue, an event, an ending) and correct agreement (a/an, he/she, was/were). The
text is the project's own, generated here, and shipped under the project's licence
(Apache-2.0); see `models/data/README.md`.

Usage:  python scripts/make_corpus.py [--out models/data/corpus.txt] [--stories 2000] [--seed 0]
The output is a pure function of (--stories, --seed): rerunning writes the same bytes.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

# --- vocabulary -------------------------------------------------------------------------------
# (name, pronoun): the pronoun drives he/she/his/her agreement in every template.
NAMES = [
    ("Tom", "he"),
    ("Anna", "she"),
    ("Ben", "he"),
    ("Lily", "she"),
    ("Sam", "he"),
    ("Mia", "she"),
    ("Max", "he"),
    ("Lucy", "she"),
    ("Leo", "he"),
    ("Emma", "she"),
    ("Jack", "he"),
    ("Rose", "she"),
    ("Finn", "he"),
    ("Ella", "she"),
    ("Noah", "he"),
    ("Ivy", "she"),
    ("Oscar", "he"),
    ("Grace", "she"),
    ("Hugo", "he"),
    ("Nora", "she"),
    ("Theo", "he"),
    ("Ruby", "she"),
    ("Felix", "he"),
    ("Clara", "she"),
    ("Peter", "he"),
    ("Sara", "she"),
    ("Oliver", "he"),
    ("Maya", "she"),
    ("Henry", "he"),
    ("Zoe", "she"),
]
ANIMALS = [
    "cat",
    "dog",
    "rabbit",
    "fox",
    "owl",
    "bear",
    "duck",
    "mouse",
    "frog",
    "horse",
    "goat",
    "pig",
    "bird",
    "squirrel",
    "turtle",
    "lion",
    "elephant",
    "deer",
    "hedgehog",
    "crow",
    "sheep",
    "cow",
    "kitten",
    "puppy",
    "badger",
    "otter",
    "goose",
    "hen",
]
ANIMAL_NAMES = [
    "Pip",
    "Bella",
    "Rex",
    "Daisy",
    "Whiskers",
    "Coco",
    "Biscuit",
    "Sunny",
    "Pepper",
    "Milo",
    "Luna",
    "Buttons",
    "Ziggy",
    "Honey",
    "Shadow",
    "Maple",
]
PLACES = [
    "park",
    "forest",
    "beach",
    "garden",
    "river",
    "farm",
    "hill",
    "village",
    "market",
    "lake",
    "meadow",
    "library",
    "school",
    "harbor",
    "bakery",
    "castle",
    "field",
    "zoo",
    "town square",
    "old mill",
    "orchard",
    "valley",
    "cave",
    "bridge",
    "playground",
]
THINGS = [
    "ball",
    "kite",
    "book",
    "hat",
    "box",
    "cake",
    "apple",
    "boat",
    "drum",
    "key",
    "map",
    "lamp",
    "cup",
    "shell",
    "stone",
    "flower",
    "blanket",
    "basket",
    "bell",
    "coat",
    "feather",
    "toy car",
    "umbrella",
    "letter",
    "pie",
    "scarf",
    "clock",
    "egg",
    "leaf",
    "jar of honey",
    "red sock",
]
COLORS = ["red", "blue", "green", "yellow", "brown", "white", "black", "orange", "purple", "pink", "gray", "golden"]
SIZES = ["big", "small", "little", "tiny", "huge", "tall", "long", "round"]
MOODS = [
    "happy",
    "sad",
    "tired",
    "brave",
    "shy",
    "curious",
    "hungry",
    "kind",
    "clever",
    "quiet",
    "proud",
    "scared",
    "sleepy",
    "grumpy",
    "cheerful",
    "gentle",
    "silly",
    "excited",
]
PLACE_ADJS = [
    "quiet",
    "busy",
    "sunny",
    "dark",
    "cold",
    "warm",
    "green",
    "beautiful",
    "old",
    "windy",
    "peaceful",
    "noisy",
    "wet",
    "bright",
    "lovely",
    "strange",
]
TIMES = [
    "morning",
    "afternoon",
    "evening",
    "day",
    "night",
    "Monday",
    "Sunday",
    "summer day",
    "winter morning",
    "rainy afternoon",
    "spring day",
    "autumn evening",
]
WEATHER = [
    "the sun was shining",
    "it was raining",
    "the wind was blowing",
    "it was snowing",
    "the sky was gray",
    "the sky was clear and blue",
    "it was very hot",
    "it was cold and foggy",
]
GOALS = [
    "find a {thing}",
    "buy some bread",
    "see the {animal}s",
    "play with {pos} friends",
    "look for {pos} {thing}",
    "pick some flowers",
    "watch the boats",
    "read a book",
    "fly {pos} kite",
    "visit {pos} grandmother",
    "catch a fish",
    "look at the stars",
    "build a sandcastle",
    "eat a picnic lunch",
    "draw a picture",
    "sing a song",
    "climb a tree",
    "collect shells",
    "feed the ducks",
    "ride {pos} bike",
]
ACTIVITIES = [
    "played in the grass",
    "ran up and down the hill",
    "looked for shiny stones",
    "sang songs",
    "told funny stories",
    "built a little house of sticks",
    "shared an apple",
    "watched the clouds",
    "splashed in the water",
    "chased the butterflies",
    "counted the birds",
    "danced in the rain",
    "made a crown of flowers",
    "had a race to the big tree",
    "sat under a tree and talked",
    "played hide and seek",
    "baked a cake",
    "read a story together",
]
PROBLEMS = [
    ("{name} could not find the way home", "the {animal} knew the way, and they walked back together"),
    ("the {thing} fell into the river", "{name} found a long stick and pulled it out"),
    ("a big storm came over the hill", "they hid in a small hut until it was over"),
    ("{name} lost {pos} {thing}", "a kind old man found it under a bench"),
    ("the little {animal} was stuck in a tree", "{name} climbed up slowly and helped it down"),
    ("it started to get dark", "the moon came out and showed them the path"),
    ("{name} was very hungry", "they shared a piece of bread and some cheese"),
    ("the bridge was broken", "they found a row of stones and crossed the stream"),
    ("{name} felt afraid of the dark {place}", "the {animal} held {obj} hand and said it was all right"),
]
SAYINGS = [
    "Hello! Do you want to play with me?",
    "What a nice day it is!",
    "I like your {thing}.",
    "Can you help me, please?",
    "Let us go to the {place} together.",
    "Thank you, my friend.",
    "I am not afraid.",
    "Look, the sun is going down.",
    "This is the best day ever!",
    "Where are you going?",
    "I have never seen a {color} {thing} before.",
    "Be careful!",
    "I think we are lost.",
    "Do not be sad. I will help you.",
    "Come with me, I know a secret place.",
]
FEELINGS = ["happy", "tired but happy", "very proud", "glad to be home", "sleepy", "full of joy", "thankful"]
ENDINGS = [
    "From that day on, {name} and the {animal} were best friends.",
    "That night, {name} went to bed with a big smile.",
    "{name} never forgot that {time}.",
    "The next {time2}, {subj} went back to the {place} again.",
    "{cap_subj} told {pos} mother all about it at dinner.",
    "And that was the end of a very good day.",
    "{name} learned that it is good to help a friend.",
]
FACTS = [
    "The {color} {thing} is on the table.",
    "The {animal} sleeps in the {place}.",
    "In the {place} there is a {size} {color} {thing}.",
    "The {size} {animal} likes to eat apples.",
    "{name} has a {color} {thing} and a {size} {thing2}.",
    "The sky is blue and the grass is green.",
    "Every {time}, the {animal} walks to the {place}.",
    "The {place} is {padj} in the {time}.",
    "A {mood} {animal} sat by the {place}.",
    "{name} and {name2} like to play in the {place}.",
]


def a(word: str) -> str:
    """Indefinite article agreement: 'an owl', 'a dog'."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def quote(saying: str) -> str:
    """A saying as quoted speech before 'said X': its final full stop becomes a comma."""
    return saying[:-1] + "," if saying.endswith(".") else saying


def cap(s: str) -> str:
    return s[0].upper() + s[1:]


class Story:
    """One story's cast and setting, so every sentence in it refers to the same things."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.name, subj = rng.choice(NAMES)
        self.subj = subj
        self.pos = "his" if subj == "he" else "her"
        self.obj = "his" if subj == "he" else "her"
        others = [n for n in NAMES if n[0] != self.name]
        self.name2, _ = rng.choice(others)
        self.animal = rng.choice(ANIMALS)
        self.animal_name = rng.choice(ANIMAL_NAMES)
        self.place = rng.choice(PLACES)
        self.place2 = rng.choice([p for p in PLACES if p != self.place])
        self.thing = rng.choice(THINGS)
        self.thing2 = rng.choice([t for t in THINGS if t != self.thing])
        self.time = rng.choice(TIMES)

    def fill(self, template: str) -> str:
        r = self.rng
        return template.format(
            name=self.name,
            name2=self.name2,
            subj=self.subj,
            cap_subj=cap(self.subj),
            pos=self.pos,
            obj=self.obj,
            animal=self.animal,
            place=self.place,
            thing=self.thing,
            thing2=self.thing2,
            time=self.time,
            time2=r.choice(TIMES),
            color=r.choice(COLORS),
            size=r.choice(SIZES),
            mood=r.choice(MOODS),
            padj=r.choice(PLACE_ADJS),
        )

    def sentences(self) -> list[str]:
        r, f = self.rng, self.fill
        s = []
        opening = r.randrange(4)
        mood = r.choice(MOODS)
        if opening == 0:
            s.append(
                f"Once upon a time, there was {a(mood)} {'boy' if self.subj == 'he' else 'girl'} named {self.name}."
            )
        elif opening == 1:
            s.append(f"{self.name} lived in {a(r.choice(SIZES))} house near the {self.place}.")
        elif opening == 2:
            s.append(f"One {self.time}, {self.name} woke up early. {cap(r.choice(WEATHER))}.")
        else:
            s.append(f"{self.name} had {a(r.choice(COLORS))} {self.thing}. {cap(self.subj)} loved it very much.")
        goal = f(r.choice(GOALS))
        s.append(f"{cap(self.subj) if opening == 2 else self.name} wanted to go to the {self.place} to {goal}.")
        if r.random() < 0.5:
            s.append(f"The {self.place} was {r.choice(PLACE_ADJS)}, and {r.choice(WEATHER)}.")
        animal_mood = r.choice(MOODS)
        s.append(f"On the way, {self.subj} met {a(animal_mood)} {self.animal} called {self.animal_name}.")
        s.append(f'"{quote(f(r.choice(SAYINGS)))}" said the {self.animal}.')
        if r.random() < 0.6:
            s.append(f'"{quote(f(r.choice(SAYINGS)))}" said {self.name}.')
        s.append(f"{self.name} and {self.animal_name} {r.choice(ACTIVITIES)}.")
        if r.random() < 0.7:
            problem, fix = r.choice(PROBLEMS)
            s.append(f"Then {f(problem)}.")
            s.append(f"But {f(fix)}.")
        if r.random() < 0.4:
            s.append(f"Later, they went to the {self.place2} and {r.choice(ACTIVITIES)}.")
        s.append(f"When {self.name} came home, {self.subj} was {r.choice(FEELINGS)}.")
        s.append(f(r.choice(ENDINGS)))
        return s


def facts(rng: random.Random) -> list[str]:
    """A short descriptive paragraph of independent simple sentences."""
    st = Story(rng)
    return [st.fill(rng.choice(FACTS)) for _ in range(rng.randint(3, 6))]


def make_corpus(stories: int, seed: int) -> str:
    rng = random.Random(seed)
    paragraphs = []
    for _ in range(stories):
        # Mostly stories; every fifth paragraph or so is plain description, for variety.
        sents = facts(rng) if rng.random() < 0.2 else Story(rng).sentences()
        paragraphs.append(" ".join(sents))
    return "\n\n".join(paragraphs) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p.add_argument("--out", default=os.path.join(here, "models", "data", "corpus.txt"))
    p.add_argument("--stories", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.stories < 1:
        print(f"make_corpus: --stories must be >= 1, got {args.stories}", file=sys.stderr)
        return 2
    text = make_corpus(args.stories, args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        fh.write(text)
    print(f"wrote {len(text.encode('utf-8'))} bytes, {args.stories} paragraphs, to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
