"""Every relative link and image in README.md names a file or folder of the repository (a picture the README
shows must be committed, not left on the machine that drew it), and every in-page link names a heading."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def links(text: str) -> list:
    """Targets of markdown links and images, `[text](target)` and `![alt](target)`, outside code."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [m.split()[0] for m in re.findall(r"!?\[[^\]]*\]\(([^)]+)\)", text)]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_and_images_exist():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    targets = links(text)
    assert any(t.endswith(".png") for t in targets), "the README shows no picture: is the parser still right?"
    headings = {anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    missing = []
    for t in targets:
        path, _, frag = t.partition("#")
        web = re.match(r"[a-z]+://", t) or t.startswith("mailto:")  # the web: not checked here
        if not web and (frag not in headings if not path else not os.path.exists(os.path.join(ROOT, path))):
            missing.append(t)
    assert not missing, f"README.md links to what is not in the repository: {missing}"


def test_readme_names_nothing_outside_the_repository():
    """No paths above the repository (`../`), which a reader of a fresh clone does not have."""
    assert "../" not in open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
