"""The project's own word lists for synthetic tasks: needle keys, extraction vocabularies, noise text."""

from __future__ import annotations

import itertools
import random
import string
import uuid

NOUNS = """
anchor apple arch badge bakery balcony ballot banner barn basket beacon bell bicycle blanket boat bottle
bridge bucket cabin cactus camera candle canyon carpet castle cellar chapel chimney circus cliff clock
cloud compass cottage crane crystal curtain dagger desert diamond dolphin dragon drum eagle engine
falcon feather fence fern ferry fiddle flag flute forest fountain fox garden garnet gate glacier
globe goose granite harbor harp hammer helmet hive horizon island ivory jacket jungle kettle kite
ladder lagoon lantern lemon library lighthouse lily lizard locket magnet mango maple marble meadow
mirror monastery mountain needle nest oak oasis orchard otter owl paddle palace parrot pebble pepper
piano pillar planet pocket pond puzzle quarry quilt rabbit raft ribbon river rocket saddle sail
scarf shell shovel silo skyline sparrow spiral spoon stadium statue steeple stone stove swan
tablet teapot temple thistle thunder tiger tower tractor trumpet tulip tunnel turtle umbrella valley
velvet village violin volcano wagon walnut waterfall whale whistle willow window wizard wolf zebra
""".split()

ADJECTIVES = """
amber ancient bold brave bright brisk calm clever cosmic crimson curious daring dusty eager early
elegant fancy fierce fragile frosty gentle giant glossy golden grand hidden hollow humble icy jolly
keen lively lucky marble mellow misty modest noble odd pale patient polite proud quick quiet rapid
rare restless rough royal rusty scarlet secret silent silver sleepy smooth solar spicy steady stormy
sturdy sunny swift tender tidy tiny vast velvet vivid wandering warm wild wise witty young zesty
""".split()

# Common English words for common-words extraction: everyday, distinct, mostly single-token-ish.
EXTRACTION_WORDS = """
able actor adult advice agency album alley angle ankle answer april arena army artist aunt autumn
baby bacon badge baker ballet bamboo banana band bank beach bean beard bench berry bill biology bird
blade block blood board body bonus book boot border bottom bowl brain branch brand bread brick
bride brother brush budget buffalo butter button cable cake camel camp canal candy canvas captain
card cargo carrot castle cattle ceiling cement cereal chain chair chalk channel cheese cherry chess
chicken child chorus cinema citizen city claim clay client climate coach coast coffee coin collar
color comedy copper corner cotton couch country cousin crowd cube culture cup dancer dealer debate
degree dentist design detail device diary dinner doctor dollar donkey door dozen drama dream dress
driver dust eagle earth editor effect egg elbow energy engine essay event exam expert fabric factory
family farmer father fever field figure film finger fish flavor flight floor flower folder food
football forest fortune frame friend fruit galaxy game garage gender ghost ginger girl glass glove
goal gold grain grape grass group guitar habit hair hall handle harvest health heart height hero
highway history hobby holiday honey horse hotel house hunter ice idea income infant ink insect
island jacket jelly jewel joke journey judge juice jury kitchen knee knife label ladder lake lamp
laptop lawyer leader leather lemon lesson letter level lion liquid list lobster lunch machine magnet
manager market meadow melon memory metal method milk minute mirror model monkey month motor mouse
movie muscle museum music nail nation nature needle nephew nerve novel number nurse ocean office
onion opera orange orbit oven owner oxygen packet paint palace panel paper parent parrot party pasta
patient peach peanut pencil pepper piano picture pillow pilot planet plastic player pocket poem
poet potato powder prison profit puzzle rabbit radio rain record reward rice river robot rocket
roof salad salmon sample sand school science season secret seed shadow sheep shelf shirt signal
silver singer sister skill sleeve soap soccer sofa soldier song sound soup spider spoon square
stamp star station steam stomach storm story student sugar summer sunset supper sweater table
tea teacher temple tennis theory ticket tiger timber tomato tongue tool tower toy traffic train
tree truck tunnel uncle union valley vessel video village violin visitor voice wagon wallet water
wealth weather wheel window winter wire wizard wolf woman wood worker yacht yard yellow zebra zone
""".split()

NOISE_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                   "There and back again.")


# Every needle key `adjective-noun` (12,397 of them): sampled without replacement, so distinct keys never
# need a retry loop and a request for more keys than exist fails loudly instead of spinning.
KEY_SPACE = [f"{adjective}-{noun}" for adjective, noun in itertools.product(ADJECTIVES, NOUNS)]


def key_word(rng: random.Random) -> str:
    """A needle key such as `brave-lantern`."""
    return rng.choice(KEY_SPACE)


def distinct_keys(rng: random.Random, count: int) -> list[str]:
    """`count` different keys; count <= len(KEY_SPACE)."""
    return rng.sample(KEY_SPACE, count)


def number_value(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def uuid_value(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def variable_name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


def coded_word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 7)))
