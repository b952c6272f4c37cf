"""The built-in text the tiny tokenizer's byte-level BPE is trained on.

It only has to be varied enough to yield the fixed number of merges (the trainer needs enough
distinct words): English prose about agents and screens, chat turns, code, numbers, punctuation
and a little non-ASCII text. Changing it changes every token id of every tiny checkpoint, so
treat it as frozen.
"""

CORPUS = r"""
You are a helpful assistant. The user sends a screenshot of the browser and asks what to click next.
The assistant looks at the screenshot, finds the search box in the upper left corner, and answers:
"Click the search box, type the name of the report, then press Enter."
An agent works in turns. Every turn it observes the screen, thinks, and acts: it clicks, scrolls,
types text, opens a terminal, reads a file, or calls a tool. A sub-agent gets its own system prompt
and a smaller task, for example summarising a long document or checking a table of numbers.
Screenshots are large images. A 1280x720 screenshot becomes 1196 image tokens after the 2x2 merge,
and a 896x504 picture becomes 576 tokens. The same image often appears again in the next turn, at a
new position in the prompt, because the window of recent screenshots slides forward by one step.
The cache recognises each image by the hash of its pixels and reuses its vision features and its
key-value cache wherever it appears again. Rotary position embeddings are re-rotated to the new
positions; a few boundary tokens are recomputed so the reused span sees its new left context.

User: What is in this picture?
Assistant: A red square on a white background, a blue circle in the lower right, and some text.
User: Read the text in the second row of the table.
Assistant: The second row says "Total: 42.50 EUR, paid on 2024-03-17 by card ending 7781".
User: Which button saves the form?
Assistant: The green button labelled "Save changes" at the bottom of the dialog.
System: Tools available: click(x, y), type(text), scroll(dx, dy), key(name), screenshot(), done().
Assistant: click(640, 360)
Assistant: type("quarterly revenue by region")
Assistant: key("Enter")
Assistant: scroll(0, -300)

def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Summarise a directory of images.")
    parser.add_argument("path", help="where the images are")
    args = parser.parse_args(argv)
    for name in sorted(os.listdir(args.path)):
        if name.endswith((".png", ".jpg", ".jpeg")):
            print(f"{name}: {os.path.getsize(os.path.join(args.path, name))} bytes")
    return 0

class BlockPool:
    def __init__(self, num_blocks, block_size):
        self.free = list(range(num_blocks))
        self.refcount = [0] * num_blocks

    def allocate(self):
        if not self.free:
            raise MemoryError("out of blocks")
        block = self.free.pop()
        self.refcount[block] = 1
        return block

{"model": "tiny", "layers": 2, "hidden_size": 128, "heads": [4, 2], "experts": null, "ok": true}
SELECT id, title, created_at FROM documents WHERE owner = 'alice' ORDER BY created_at DESC LIMIT 10;
<html><body><h1>Monthly report</h1><p>Sales grew 12% in March and 7% in April.</p></body></html>
$ ls -la /home/user/projects && git status && git log --oneline | head -3
0 1 2 3 4 5 6 7 8 9 10 11 12 16 24 32 48 64 100 128 256 512 1000 1024 2048 4096 65536 3.14159 2.71828

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
Yesterday the weather was cloudy, today it is sunny and warm, and tomorrow it will rain again.
Mathematics, physics, chemistry, biology, history, geography, literature, music and painting.
January February March April May June July August September October November December.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday; morning, afternoon, evening, night.
one two three four five six seven eight nine ten eleven twelve hundred thousand million billion
north south east west left right up down top bottom inside outside before after above below
red orange yellow green blue indigo violet black white grey brown pink purple gold silver
cat dog horse cow sheep goat bird fish mouse rabbit tiger lion bear wolf fox deer eagle whale
apple banana cherry grape lemon mango orange peach pear plum strawberry tomato potato carrot
kitchen bedroom bathroom garden window door table chair sofa lamp shelf mirror carpet ceiling
computer keyboard monitor printer laptop phone tablet camera speaker cable router server cloud
Please describe the chart: the x axis shows the years from 2019 to 2025, the y axis shows users
in thousands, and the line rises steadily except for a dip in 2021.
Grounding: the logo is at (12,34),(120,80) and the menu at (900,10).
Café, naïve, résumé, façade, Zürich, São Paulo, Kraków, Ελληνικά, Русский, 日本語, 中文, 한국어.
Errors are reported as exceptions; nothing aborts the process. Retry after a short delay.
The model reads the document page by page, extracts the key facts, and writes a short summary
with the title, the authors, the date, the main findings and the open questions.
"""
