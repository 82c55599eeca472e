// Renders the formulas of the site with the vendored KaTeX (docs/assets/katex/): the Markdown
// pages' math, which pymdownx.arithmatex (generic mode) wraps in span/div.arithmatex as \( \)
// and \[ \], and the $ / $$ math of the notebooks' Markdown cells (inside .jupyter-wrapper).
(function () {
  function render() {
    if (typeof renderMathInElement !== "function") return;
    var opts = {throwOnError: false, strict: "ignore"};
    document.querySelectorAll(".arithmatex").forEach(function (el) {
      renderMathInElement(el, Object.assign({}, opts, {delimiters: [
        {left: "\\(", right: "\\)", display: false},
        {left: "\\[", right: "\\]", display: true}]}));
    });
    document.querySelectorAll(".jupyter-wrapper .jp-MarkdownOutput").forEach(function (el) {
      renderMathInElement(el, Object.assign({}, opts, {delimiters: [
        {left: "$$", right: "$$", display: true},
        {left: "$", right: "$", display: false}]}));
    });
  }
  if (window.document$ && window.document$.subscribe) { window.document$.subscribe(render); }
  else { document.addEventListener("DOMContentLoaded", render); }
})();
