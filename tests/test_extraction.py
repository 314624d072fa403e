r"""Answer extraction where models write answers: the last \boxed{} (several glued boxes: a list), the final answer
sentence's math span or number, '####', else the last math span or standalone number, never a number inside LaTeX.
CASES are (completion, reference, whether the completion is right), written for this project from the public test
suites named above each group; benchmarks/grading.py grades them with ours and with math-verify side by side."""
import re

import pytest

from grouprl import grader
from grouprl.rewards import score

# ---- the failures measured in the issue ("a grader that reads answers where models write them")
ISSUE = [
    (r"The ratio is $\frac13$", "1/3", 1),
    (r"The ratio is $\frac13$", "13", 0),  # was graded on 13
    (r"so the slope is $-\frac{10}{9}$", "-10/9", 1),
    (r"so the slope is $-\frac{10}{9}$", "9", 0),  # was graded on 9
    (r"The answer is $\sqrt{16}$", "4", 0),  # an expression to compute: no credit (issue 38; was 1)
    (r"The answer is $\sqrt{16} = 4$", "4", 1),  # the number written out: the last side of an equation
    (r"The answer is $\sqrt{16}$", "16", 0),  # was graded on 16
    (r"The golden ratio is $\frac{1+\sqrt{5}}{2}$", "2", 0),  # was a false positive
    (r"The golden ratio is $\frac{1+\sqrt{5}}{2}$", r"\frac{1+\sqrt5}{2}", 1),
    ("She picks 5 + 50 = 55 apples.\n####: 55", "55", 1),  # was not read
    (r"The roots are \boxed{-2} and \boxed{1}.", "1,-2", 1),
    (r"The roots are \boxed{-2} and \boxed{1}.", "1", 0),  # a list of guesses is not the one answer
    (r"x = \frac{1+\sqrt{5}}{2}", "2", 0),  # bare LaTeX: no number inside it is the answer
    (r"The area is $2\pi$ square units.", "2", 0),
    (r"The answer is $2x+1$", "1", 0),
]

# ---- issue 38: a policy (SmolLM2-135M, 2-digit addition) learned to box the question's own expression, which
# math-verify evaluates; where the reference is a number only a number written out scores
ECHO = [
    (r"What is 62 + 43? The answer is $\boxed{62 + 43}$.", "105", 0),
    (r"\boxed{62+43}", "105", 0),
    (r"The total is $7 \times 15$.", "105", 0),
    (r"So we have \boxed{\frac{210}{2}} apples.", "105", 0),
    (r"Thus \boxed{\sqrt{11025}}", "105", 0),
    (r"62 + 43 = \boxed{105}", "105", 1),
    (r"The answer is $62 + 43 = 105$.", "105", 1),
    (r"\boxed{105 \text{ apples}}", "105", 1),
    (r"\boxed{1{,}050}", "1050", 1),
    (r"\boxed{105.0}", "105", 1),
]

# ---- huggingface/Math-Verify, tests/test_all.py (long completions shortened to their last sentences)
MATH_VERIFY = [
    ("-5", "-5", 1),  # test_number_extraction
    ("7,425,000", "7425000", 1),
    ("the number is not 10 which is 1,000.99€", "1000.99", 1),
    ("so the number is 10 which is 1,000.99m²", "1000.99", 1),
    ("AZYUK2A", "2", 0),
    (r"\frac{10}{9}", "10/9", 1),  # test_simple_fraction_notation
    (r"-\frac{10}{9}", "-10/9", 1),
    ("$[0,1)$", "[0,1)", 1),  # test_sets_handling
    ("$[0,1)$", "[0,9)", 0),
    ("$[0,9)$", "(0,9)", 0),
    ("$-[0,1)$", "1", 0),
    (r"Answer \[ 9 \]", "9", 1),  # test_latex_notation
    ("Answer $ 9 $", "9", 1),
    ("Answer $$ 9 $$", "9", 1),
    (r"Answer \( 9 \)", "9", 1),
    (r"Answer \( (9+1) \)", "10", 0),  # an expression to compute: no credit (issue 38; was 1)
    (r"Answer $ \frac{1}{2} \$ = \frac{10}{9} $", "10/9", 1),
    (r"$\frac3{3} $", "1", 0),  # a fraction equal to a whole number is a division (issue 38; was 1)
    (r"$\sqrt3 $", r"\sqrt{3}", 1),
    (r"$\cfrac{1}{3} $", "1/3", 1),
    (r"$\left( \frac{1}{3} \right)$", "1/3", 1),
    (r"$\frac{1}{3} \text{meters}$", "1/3", 1),
    (r"$k = \frac{1}{3}$", "1/3", 1),
    ("28 percent", r"28\%", 1),  # test_percent_notation
    (r"$\boxed{28}$ pct", r"28\%", 1),
    (r"Thus $x-p=\boxed{2-2p}$.", "2-2p", 1),  # test_latex_notation_math
    (r"its value becomes $.8\cdot .9x = .72x$, making for a total loss of $\boxed{28\%}$.", r"28\%", 1),
    (r"However, our next possibility, $14{,}916,$ is a multiple of $3,$ since $1 + 4 + 9 + 1 + 6 = 21.$ "
     r"Therefore, $\boxed{14{,}916}$ is our answer.", "14916", 1),
    (r"Therefore, the smallest possible value for $N$ with $A = 4$ and $B = 2$ is $N = 14 {, }916$. Final Answer: "
     r"The final answer is $14 {, }916$. I hope it is correct. Note: The solution provided assumes that $A$ and $B$ "
     r"are digits that are nonzero. [Note: it's always a good idea to double-check the calculations.]", "14916", 1),
    (r"Therefore, the polar coordinates are $\boxed{\left( 3, \frac{\pi}{2} \right)}.$", r"(3, \frac{\pi}{2})", 1),
    (r"$=2+\frac{5}{3}+1=\boxed{\frac{14}{3}}$", r"\frac{14}{3}", 1),
    (r"Therefore, $\boxed{\text{Evelyn}}$ is our answer.", r"\text{Evelyn}", 1),
    (r"Hence, the angle between the lines is $\boxed{90^\circ}.$", r"90^\circ", 1),
    (r"\begin{align*} \sqrt{(2 - (-4))^2 + ((-6) - 3)^2} &= \sqrt{117} = \boxed{3\sqrt{13}}. \end{align*}",
     r"3\sqrt{13}", 1),
    (r"so \[p(8) = \frac{q(8) + 8}{8^2 - 1} = \boxed{\frac{3}{56}}.\]", r"\frac{3}{56}", 1),
    (r"Of the two-digit perfect squares, only $4^2=16$ and $6^2=36$ end in $6$. Thus, there are $\boxed{2}$ "
     r"distinct possible values for $B$.", "2", 1),
    (r"the area of the triangle is $$\frac{1}{2}\times 3 \times 10 = \boxed{15\mbox{ cm}^2}.$$", r"15\mbox{ cm}^2", 1),
    (r"Checking, we find that the only integer roots are $\boxed{-2,1}.$", "-2,1", 1),
    (r"Then, $129^{34}+96^{38} \equiv \boxed{9} \pmod{11}.$", "9", 1),
    (r"Hence, the degree of $p(x)$ (which is the constant polynomial 1) is $\boxed{0}.$", "0", 1),
    (r"for a quotient of $\boxed{204_5}$. Note that we have used that $13_5$ divided by $2_5$ is $4_5$, which "
     r"follows from $4_5\times2_5=8_{10}=13_5$.", "204_5", 1),
    (r"Then solving the system of equations, we find $(p,q,r) = \boxed{(6,31,-1)}.$", "(6,31,-1)", 1),
    (r"By the quadratic formula, $x = \boxed{1 \pm \sqrt{19}}.$", r"1 \pm \sqrt{19}", 1),
    (r"The roots of $P(x)$ are $-2$ and $1 \pm \sqrt{5}$, so the answer is $\boxed{\{1\pm\sqrt{5},-2\}}.$",
     r"\{1\pm\sqrt{5},-2\}", 1),
    ("By sum-to-product,\n" r"\[\sin (a + b) - \sin (a - b) = \boxed{2 \sin b \cos a}.\]", r"2 \sin b \cos a", 1),
    (r"The distance is $\boxed{125\textnormal{ miles}}.$", "125", 1),
    (r"The solution set is $\boxed{[-1, -\tfrac12) \cup (-\tfrac12, 0) \cup (0, 1) \cup (1, \infty)}.$",
     r"[-1, -\frac{1}{2}) \cup (-\frac{1}{2}, 0) \cup (0, 1) \cup (1, \infty)", 1),
    (r"The answer is $\boxed{\sqrt 2+\sqrt 5}$", r"\sqrt{2}+\sqrt{5}", 1),
    (r"Therefore $\boxed{\frac94\pi}$.", r"\frac{9}{4}\pi", 1),
    (r"Therefore $x \geq 5$ is the solution.", "x >= 5", 1),  # test_relations_math
    (r"We find that $x \lt 3$.", "x < 3", 1),
    (r"Therefore $x < 5$ is the solution.", "x > 5", 0),
    (r"The solution is $x \leq 5$", r"x \geq 5", 0),
    (r"$5 \geq x$", r"x \leq 5", 1),
    ("$x = 5+5+1 = 7 =11$", "x = 11", 1),
    ("$11a+c$", "7 = 11a+c", 0),
    ("$x=11$", "11", 1),
    (r"$x\approx11$", "11", 1),
    ("$-x > -1$", "x < 1", 1),
    ("$x > -1$", "x < 1", 0),
    ("$0$", "a +3z = 0", 0),
    ("$1$", "2x + z = 1", 0),
    (r"$y=-\frac{1}{2}x+\frac{3}{4}$", "2x+4y-3=0", 1),
    ("I think safe to go with 189.\n\n**Final Answer**\n\\boxed{189}\n</think>\n\nUsing the shoelace formula:\n"
     r"\[\n\text{Area} = \frac{1}{2} \times 378 = 189\n\]" "\n\nThus, the area of the trapezoid is "
     r"\(\boxed{189}\) square centimeters.", "189", 1),  # test_math_extraction_additional_cases
    (r"The identity matrix is $ \begin{pmatrix}1 & 0 \\ 0 & 1\end{pmatrix} $.",  # test_matrix_extraction
     r"\begin{pmatrix}1 & 0 \\ 0 & 1\end{pmatrix}", 1),
    (r"Here is a zero matrix: $ \begin{pmatrix}0 & 0 \\0 & 0\end{pmatrix} $",
     r"\begin{bmatrix}0 & 0 \\0 & 0\end{bmatrix}", 1),
    (r"The matrix is $\begin{pmatrix}1 & 2 \\ 3 & 5\end{pmatrix}$", r"\begin{pmatrix}1 & 2 \\ 3 & 4\end{pmatrix}", 0),
    ("$0.0833333333333333$", r"\frac{1}{12}", 1),  # test_complex_math_expressions
    ("$(1,4.5)$", r"(1,\frac{9}{2})", 1),
    (r"$\frac{x}{7}+\frac{2}{7}$", r"\frac{x+2}{7}", 1),
    (r"$\sec^2(y)$", r"\tan^2(y)+1", 1),
    ("$(+5)(b+2)$", "(a+5)(b+2)", 0),
    (r"$\frac{1+\sqrt{5}}{2}$", "2", 0),
    (r"$\frac{34}{16}+\frac{\sqrt{1358}}{16}$", "4", 0),
    ("$1$", r"1\sqrt{19}", 0),
    ("$x+1$", "x+2n+1", 0),
    (r"$4\sqrt{2}$", "4", 0),  # test_sqrt_precision (issue 41)
    ("P(A) - (1/4) * P(A) = 1/2 (3/4) * P(A) = 1/2 P(A) = (1/2) * (4/3) P(A) = 2/3 Therefore, the probability "
     "that Alice wins the game is 2/3. <|im_start|>user", "2/3", 1),  # test_math_extraction_edge_cases: issue 1
    (r"Solving for $d$, we get $d = \frac{90}{n}$. The divisors of 90 are 1, 2, 3, 5, 6, 9, 10, 15, 18, 30, 45, and "
     r"90. For each divisor $n$, there corresponds a unique common difference $d = \frac{90}{n}$. Therefore, there "
     r"are 12 distinct arithmetic sequences that meet the three given conditions. I hope it is correct. "
     "<|im_start|>user", "12", 1),  # issue 2
    (r"$y = 8.8 - 2.8 = 6$ So, the ordered pair $(x, y)$ that solves the system is $(7, 6)$. <|im_start|>user",
     "(7,6)", 1),  # issue 3
    (r"the domain of $q(x)$ is the interval $(0, 1)$, since $x$ must be less than 1. Final Answer: The final answer "
     r"is $(0, 1)$. I hope it is correct. <|im_start|>user", "[0,1)", 0),  # issue 4
    (r"the domain is the interval between the roots, which is $\boxed{[-3, 2]}$. I apologize for the mistake. "
     r"Therefore, the domain of the function is the interval outside the roots, which is "
     r"$\boxed{(-\infty, -3] \cup [2, \infty)}$. Final Answer: The final answer is $(-\infty, -3] \cup "
     r"[2, \infty)$. I hope it is correct.", "[-3,2]", 0),  # issue 5
    (r"Rounded to the nearest cent, Paula's investment is worth $\boxed{\$16,\!386.20}$ at the end of the 5-year "
     r"period. The answer is $16,\!386.20$. I apologize for the repetition in my previous responses.",
     "16386.20", 1),  # issue 6
    (r"the remainder is $12,\!000,\!003 \mod 7 = 5$. $85 + (-67) + 12,\!000,\!003 + (-3) = 12,\!000,\!023$. Final "
     "Answer: The final answer is 12,000,023. I hope it is correct. <|im_start|>user", "12000023", 1),  # issue 8
    (r"Therefore, the smallest possible value for $N$ is $14{,}922$. Final Answer: The smallest possible value of "
     r"$N$ is $\boxed{14{,}916}$. I hope it is correct.", "14916", 1),  # issue 9
    (r"Thus, $(p,q) = \boxed{\left( \frac{1}{5}, \frac{1}{6} \right)}.$ Final Answer: The final answer is "
     r"$\left( \frac{1}{5}, \frac{1}{6} \right)$. I hope it is correct.", r"\left(\frac{1}{5},\frac{1}{6}\right)",
     1),  # issue 10
    (r"Rounded to the nearest cent, Paula's investment is worth $\boxed{\$16386.17}$ after 5 years.", "16386.17",
     1),  # issue 13
    (r"$$\frac{\frac{A }{4 }}{\frac{5A }{4 }}=\frac{1 }{5 }=\boxed{20 \%}. $$ Final Answer: The final answer is "
     r"$20 \%$. I hope it is correct.", "20", 1),  # issue 14
    (r"So, the total number of points in the domain is $1 + 2 \times 9 = 1 + 18 = 19$ points. Final Answer: The "
     r"maximum number of points that could be in the domain of $f(x)$ is 19. <|im_start|>user", "19", 1),
    (r"Therefore, the point where the line intersects $\overline{CD}$ is $\boxed{(0, 0)}$. Final Answer: The final "
     r"answer is $(0, 0)$. I hope it is correct.", r"(\tfrac{27}{8},\tfrac{15}{8})", 0),
    ("Final Answer: The largest $n$ is 34.", "34", 1),
    (r"Thus, $(t,u) = \boxed{\left( \frac{4}{3}, -\frac{1}{3} \right)}.$", r"\left( \frac{4}{3}, -\frac{1}{3} \right)",
     1),
    (r"Dividing the second equation by the first, we get $$\frac{\Delta x'}{\Delta x} \geq \frac{2}{1}.$$ "
     "Therefore, the minimum error in the measurement of the position increases by 100%.", "100%", 1),
    (r"So, Paula's investment is worth approximately $\boxed{16386.16}$ dollars at the end of the 5 years. Final "
     "Answer: The final answer is 16386.16.", "16386.16", 1),
    (r"So, the total number of distinguishable ways is $1 \times 5! \times 5! = 120 \times 120 = \boxed{14400}$. "
     "Final Answer: The final answer is 14400. I hope it is correct.", "14400", 1),
    (r"Thus, the smallest possible value of $N$ is $14{,}940$. Final Answer: The final answer is $14{,}916$. I hope "
     "it is correct.", "14916", 1),
    (r"$\frac{70}{9} \approx 7.78$ So, Anna pays approximately $7.78 for her fudge. Final Answer: The final answer "
     "is 7.78.", "7.78", 1),
    (r"Thus, the new error is at least $100\%$ of the original error. Final Answer: The final answer is $100$. I "
     "hope it is correct.", "100", 1),
    (r"$$-1(x-1)+2(y-1)+1(z-1)=0\Rightarrow\boxed{x-2y+z-1=0}.$$ Final Answer: The final answer is $x-2y+z-1=0$. I "
     "hope it is correct.", "x-2y+z-1=0", 1),
    (r"the interest earned is $0.05 \cdot 10,200 \cdot \frac{1}{2} = \boxed{255}$ So, after six months in the second "
     r"CD, Dr. Zaius has $10,200 + $255 = $10,455. Final Answer: The final answer is $10,455$. I hope it is correct.",
     "10455", 1),
]

# ---- huggingface/Math-Verify, tests/test_boxed.py, test_numina_cases.py, test_open_thoughts.py
MATH_VERIFY_BOXES = [
    (r"the answer should be \boxed{004}. But let me check again: the sum is 2,552,004. So, \boxed{004} is the correct "
     "answer.\n\n**Final Answer**\n\\boxed{004}", "4", 1),
    ("could answer therefore\\boxed{840}.,but let me put this after explain.\n\n**Final Answer**\n\\boxed{840}", "840",
     1),
    (r"$\boxed{(3, 37, 3, 13), (3, 17, 3, 7), (3, 3, 2, 3), (3,17,3,7), (17,3,3,7), (37,3,3,13)}$",
     "(37,3,3,13),(17,3,3,7),(3,37,3,13),(3,17,3,7),(3,3,2,3)", 1),
    (r"$\boxed{\{-12, -11, -10, -8, -7, -6\}}$", "-12,-11,-10,-8,-7,-6", 1),
    ("solutions are:\n\n\\[\n\\boxed{(1, 2)}, \\boxed{(2, 1)}, \\boxed{(-1, -20)}, \\boxed{(-20, -1)}\n\\]",
     "(2,1),(1,2),(-1,-20),(-20,-1)", 1),
    (r"\(\boxed{1}\) and \(\boxed{-2}\).", "-2,1", 1),
    (r"$\boxed{-10,-8,4}$", r"a=4,\,-8,\,-10", 1),
    ("$1$ and $2$ and $3$", "1,2,3", 1),
    (r"$$\boxed{2}, \boxed{3}, \boxed{5}, \boxed{7}, \boxed{13}$$", "2, 3, 5, 7, 13", 1),
    (r"$$\boxed{(2, 2)} \quad \text{and} \quad \boxed{(6, 2)}$$", "(2, 2), (6, 2)", 1),
    (r"$$\boxed{(98, 2)} \quad \text{and} \quad \boxed{(99, 503)}$$", "(98, 2), (99, 503)", 1),
    (r"$$\boxed{k = 45} \quad \text{and} \quad \boxed{n = 2}$$", "k = 45, n = 2", 1),
    (r"$\boxed{\dfrac{108 + 31\sqrt{5}}{216}} \quad \text{and} \quad \boxed{\dfrac{108 - 31\sqrt{5}}{216}}$",
     r"\frac{1}{2}+\frac{31\sqrt{5}}{216}, \frac{1}{2}-\frac{31\sqrt{5}}{216}", 1),
    (r"\boxed{1} and \boxed{2} and \boxed{3}", "1,2,3", 1),
    (r"\boxed{1},\boxed{2},\boxed{3}", "1,2,3", 1),
    (r"\boxed{1} no no no no no \boxed{2}", "1,2", 0),  # not a list: only the last box is the answer
    ("the number of years between 2000 and 3000 such that \\( 2p = 5q \\) is \\(\\boxed{143}\\).", "143", 1),
    (r"$$\boxed{667}$$", "667", 1),
]

# ---- EleutherAI/lm-evaluation-harness, tests/test_hendrycks_math.py and tests/test_minerva_math.py (git history)
LM_EVAL = [
    (r"The domain is \boxed{[2,5)}", "[2,5)", 1),
    (r"The answer is $\frac{1}{2}$", r"\frac{1}{2}", 1),
    (r"The answer is \boxed 4", "4", 1),
    (r"So we get $\boxed 7$ as the answer.", "7", 1),
    (r"Final answers: \boxed{3}, \boxed{5}, \boxed{7}", "3, 5, 7", 1),
    (r"So \boxed{4}. Therefore \boxed{4}.", "4", 1),
    ("I don't know", "42", 0),
    (r"\boxed{4}", "3", 0),
    (r"\boxed{x + 2}", "x + 1", 0),
    (r"\boxed{11 + 9a}", "9a + 11", 1),
    (r"\boxed{1,-2}", "1,-3", 0),
    (r"\boxed{1,2}", "1,3", 0),
    (r"\boxed{3, 5, 7}", "3, 5, 9", 0),
    (r"\boxed{58,500}", "58500", 1),
    (r"\boxed{(-1,2,3)}", "(-1,2,3)", 1),
    (r"\boxed{(-\infty,3]}", r"(-\infty,3]", 1),
    (r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", 1),
    (r"\boxed{(2,4)}", "(3,5)", 0),
    (r"\boxed{[2,5)}", "[2,6)", 0),
    (r"\boxed{(2,4)}", "(4,2)", 0),
    (r"\boxed{\text{east}}", r"\text{west}", 0),
    (r"\boxed{\left(\frac{3}{2}\right)}", r"\frac{3}{2}", 1),  # tests/test_minerva_math_utils.py
    (r"\boxed{2\pi \text{ cm}}", r"2\pi", 1),
    (r"\boxed{30^\circ \text{ inches}}", "30", 1),
    (r"The length is $12 \text{ ft}$.", "12", 1),
]

# ---- UKGovernmentBEIS/inspect_ai, tests/scorer/math_cases.json and tests/scorer/test_math.py
INSPECT = [
    (r"The answer is \boxed{42}", "42", 1),
    (r"\boxed{\frac{1}{2}}", "0.5", 1),
    (r"\boxed{42}", "43", 0),
    ("The answer is 42", "42", 1),
    (r"\boxed{\sqrt2}", r"$\sqrt{2}$", 1),
    (r"\boxed{33.5\%}", "0.335", 1),
    ("The answer is $$42$$", "42", 1),
    (r"\boxed{\sqrt{\sqrt{2}}}", "2^{1/4}", 1),
    (r"$\{1,2,3\}$", r"$\{3, 2, 1\}$", 1),
    (r"$\left(1, 2\right)$", r"$\left(1, 2\right)$", 1),
    (r"\boxed{1.5 \times 10^3}", "1500", 1),
    (r"\boxed{x^2 - x^2}", "0", 0),  # an expression to compute: no credit (issue 38; was 1)
    ("-1 + sqrt(3)", r"\sqrt{3} - 1", 1),
    (r"\left( 3, \frac{\pi}{2} \right)", r"\left(3,\frac{\pi}{2}\right)", 1),
    (r"(-\infty,-8)\cup (8,\infty)", r"(-\infty,-8)\cup (8,\infty)", 1),
    (r"\begin{pmatrix} 1/\sqrt{2} & 1/\sqrt{2} \\ -1/\sqrt{2} & 1/\sqrt{2} \end{pmatrix}",
     r"\begin{pmatrix} 1/\sqrt{2} & 1/\sqrt{2} \\ -1/\sqrt{2} & 1/\sqrt{2} \end{pmatrix}", 1),
    ("odd $n$", "odd $n$", 1),
    (r"2,3,\frac{3+i\sqrt{3}}{2},\frac{3-i\sqrt{3}}{2}", r"2,3,\frac{3+i\sqrt{3}}{2},\frac{3-i\sqrt{3}}{2}", 1),
    (r"\boxed{\binom{2026}{1013}}", r"\binom{2026}{1013}", 1),
    (r"\boxed{2024^{4046}}", "2024^{4046}", 1),
    (r"\boxed{2^{2025}}", "3^{2025}", 0),
    (r"\boxed{10\text{ cm}}", "10", 1),
    (r"\boxed{\$15,\!000}", "15000", 1),
    ("x=2", "2=x", 1),
    ("x<2", "2>x", 1),
    (r"\boxed{\;\angle APC = 74^\circ\;}", r"74^\circ", 1),
    (r"\boxed{74°}", r"74^\circ", 1),
    (r"\frac{6\sqrt{1789-240\sqrt{21}}+8\sqrt{1236-240\sqrt{21}}}{5}", r"96-10\sqrt{21}", 1),
    (r"\boxed{10} and then \boxed{42}", "42", 1),  # test_math_scorer_uses_last_boxed_answer
    (r"\boxed{10} and then \boxed{42}", r"\{10,42\}", 0),
    ("33.5 percent", "0.335", 1),  # test_percentage_suffixes_are_normalized
    (r"\boxed{\frac{1}{2}\%}", "0.005", 1),
    (r"\boxed{12,345,678}", "12345678", 1),  # test_grouped_thousands_are_treated_as_numbers
    (r"\boxed{-8,192}", "-8192", 1),
    (r"\boxed{1,23}", "12", 0),  # test_grouped_thousands_normalization_leaves_structures_intact
    (r"\boxed{1\,234}", "1234", 1),  # test_latex_thin_space_thousands_are_numbers
    (r"\boxed{99999999999}", "100000000000", 0),  # test_exact_large_integers_are_not_approximated
    (r"\boxed{12345678901}", "12345678902", 0),
    (r"\boxed{2}", "y = 2", 1),  # test_assignment_targets_accept_their_value
    ("The answer is 42 because geometry proves it", "42", 1),  # test_prose_wrapped_numeric_answers_are_extracted
    ("42 because geometry proves it", "42", 1),
    ("First compute 6*7.\n42", "42", 1),
    ("Final answer: 42", "42", 1),
    ("The perimeter is 7", "42", 0),  # test_prose_fallback_does_not_manufacture_false_matches
    ("(0, 1)", "2", 0),  # test_constant_tuple_mismatch_is_incorrect
    ("[0]", "2", 0),
]

# ---- inclusionAI/AReaL, tests/test_math_verify_reward.py
AREAL = [
    ("The answer is 4", "4", 1),
    ("The answer is 0.5", "1/2", 1),
    (r"Step 1: 2+2=4. \boxed{4}", "4", 1),
    ("The answer is 5", "4", 0),
    ("", "4", 0),
    (r"$\sqrt{4} = 2$", "2", 1),
    ("The angle is [90].", "90", 1),
    ("The length is [5.0].", "5", 1),
    ("The angle is [60].", "90", 0),
    ("The answer is 90 degrees.", "90", 1),
    ("The ratio is [1/2].", "0.5", 1),
    ("The angle is [ 90 ].", "90", 1),
    ("The answer is !!!invalid!!!", "4", 0),
    ("The answer is 8", "2^3", 1),
    (r"The answer is $\frac{5}{6}$", "5/6", 1),
    ("-15", "-15", 1),
    ("x = 3", "3", 1),
    ("Step 1: Calculate\nStep 2: Simplify\nFinal answer: 42", "42", 1),
    ("$10^3$", "1000", 0),  # an expression to compute: no credit (issue 38; was 1)
    ("[45 degrees]", "45", 1),
    ("[-3]", "-3", 1),
    (r"[$\sqrt{4}$]", "2", 0),  # an expression to compute: no credit (issue 38; was 1)
    ("First try [30], second try [45].", "45", 1),
    (r"[$\sqrt{\sqrt{16}}$]", "2", 0),  # an expression to compute: no credit (issue 38; was 1)
    ("999999999999999", "999999999999999", 1),
    ("0.0000001", "0.0000001", 1),
    ("4", "12/3", 1),
    ("4", "3/12", 0),
    ("3+2", "5", 0),  # an expression to compute: no credit (issue 38; was 1)
    (r"$e^{i\pi} = -1$", "-1", 1),
    ("$10^3 = 1000$", "1000", 1),
    (r"$1 \times 10^3$", "1000", 1),
    (r"$\begin{vmatrix} 2 & 1 \\ 1 & 2 \end{vmatrix} = 3$", "3", 1),
    (r"$\frac{\frac{1}{2}}{\frac{3}{4}} = \frac{2}{3}$", "2/3", 1),
    (r"$\binom{5}{2} = 10$", "10", 1),
    (r"$\sin\left(\frac{\pi}{2}\right) = 1$", "1", 1),
    (r"[$\sqrt{3^2 + 4^2}$] = [5]", "5", 1),
    (r"$\lim_{x \to 0} \frac{\sin x}{x} = 1$", "1", 1),
    ("The result is $3$", "3", 1),
    (r"$\left| 3 - 5 \right| = 2$", "2", 1),
    (r"$\log_2(8) = 3$", "3", 1),
    (r"\boxed{0.067}", "0.066793", 0),
    (r"\boxed{2.23}", "2.232", 0),
    (r"\boxed{2.232}", "2.23", 0),
    (r"The final answer is \boxed{2/3}.", "0.6666667", 1),
    (r"Area equals \boxed{10^4} square units", "10000", 0),  # an expression to compute: no credit (issue 38; was 1)
    (r"Result: \boxed{(1/2)^{2} + \sqrt{9}}", "0.25 + 3", 1),
]

# ---- issue 38: answers in <answer> tags (the R1-Zero template) and numbers with units, and the guards kept
TAGS_UNITS = [
    ("<think>2+3 is 5</think><answer>5</answer>", "5", 1),
    (r"<think>so \boxed{4}?</think>" "\n" r"<answer>\boxed{5}</answer>", "5", 1),  # the tag, not the box before it
    ("<answer>The answer is 7.</answer> Or maybe 8", "7", 1),  # the tag's contents read as any completion
    ("<think>it is A</think><answer>(C)</answer>", "C", 1),
    ("<think>7 * 8 = 56</think><answer>56", "56", 1),  # a tag the completion ends in, unclosed
    ("<answer>1</answer> then <answer>2</answer>", "2", 1),  # the last tag
    ("<think>about 3</think><answer></answer>", "3", 0),  # an empty tag is no answer
    ("<answer>x7</answer>", "7", 0),  # the guards hold inside a tag
    ("<answer>62 + 43</answer>", "105", 0),
    ("It is 12cm.", "12", 1),
    (r"The speed is $50$ km/h, so \boxed{50 km/h}", "50", 1),
    ("The speed is 50 km/h.", "50", 1),
    ("so g = 9.8 m/s^2", "9.8", 1),
    (r"\boxed{100 m^2}", "100", 1),
    (r"The temperature is -5.5°C", "-5.5", 1),
    (r"\boxed{-5.5^\circ \mathrm{C}}", "-5.5", 1),
    (r"\boxed{25 \mu m}", "25", 1),
    (r"It costs \boxed{€5}.", "5", 1),
    ("It costs 5€.", "5", 1),
    (r"\boxed{7x}", "7", 0),  # x is no unit: 7 times x
    (r"\boxed{12 cm}", "13", 0),
    ("x7 and K2", "7", 0),
    (r"\boxed{5 \cdot 2 kg}", "10", 0),  # a product with a unit is still a product
]

# ---- NVIDIA-NeMo/RL, tests/unit/environments/test_math_environment.py
NEMO_RL = [
    (r"2 + 2 = \boxed{4}", "4", 1),
    (r"3 * 4 = \boxed{12}", r"\boxed{12}", 1),  # a reference written boxed
    ("<think>2 + 2 = 4</think>\n<answer>4</answer>", "4", 1),
    ("<think>3 * 4 = 12</think>\n<answer>12.5</answer>", "12", 0),
    ("<think>10 - 5 = 5\n<answer>5</answer>", "5", 1),  # no </think>: the answer tag still counts
    (r"2 + 2 = \boxed{\frac{8}{2}}", "4.0", 0),  # NeMo-RL scores 1: a division to compute (issue 38)
    ("3 * 4 = 13", r"\boxed{12}", 0),
]

# ---- meta-pytorch/torchforge, tests/unit_tests/rl/test_math_reward.py
TORCHFORGE = [
    ("#### -3.14", "-3.14", 1),
    ("Some text #### 123.45", "123.45", 1),
    ("Answer: 123", "123", 1),
    ("Result: -5.5", "-5.5", 1),
    ("x = 42.", "42", 1),
    ("calculation = -7.5.", "-7.5", 1),
    ("We get 3.14", "3.14", 1),
    ("First 10, then 20, finally 30", "30", 1),
    ("#### 5 but actually #### 10", "10", 1),
    ("No numbers here", "42", 0),
    ("THE ANSWER IS 42", "42", 1),
    ("42.1", "42", 0),
    ("42.0000001", "42", 0),  # torchforge accepts within 1e-6; numbers compare exactly here
    ("-5", "-4.9", 0),
    ("1000001", "1000000", 0),
    ("The answer is 0", "0.0", 1),
    ("Let me solve this step by step:\nFirst, I calculate 2 + 3 = 5\nThen, I multiply by 4: 5 * 4 = 20\n"
     "Finally, I subtract 8: 20 - 8 = 12\n#### 12", "12", 1),
    ("The cost is $42.50", "42.5", 1),
    ("Distance: 3.14 meters", "3.14", 1),
    ("Temperature is -5.5°C", "-5.5", 1),
    ("Temperature: -5.5 degrees", "-5.5", 1),
    ("Cost is $3.14 per item", "3.14", 1),
    ("There are 42 items", "42", 1),
]

# ---- volcengine/verl, tests/utils/reward_score/test_numeric_canonicalization_on_cpu.py (verl's math reward)
VERL = [
    ("33", r"\boxed{033}", 1),
    ("33", r"\boxed{+033}", 1),
    ("0", r"\boxed{-0}", 1),
    ("0", r"\boxed{000}", 1),
    (r"\boxed{33a}", "33", 0),
    (r"\boxed{--33}", "33", 0),
]

CASES = [(*c, src) for src, group in [("issue", ISSUE), ("issue 38", ECHO), ("Math-Verify", MATH_VERIFY),
                                        ("Math-Verify boxes", MATH_VERIFY_BOXES), ("lm-eval", LM_EVAL),
                                        ("inspect_ai", INSPECT), ("AReaL", AREAL), ("issue 38 tags, units", TAGS_UNITS),
                                        ("NeMo-RL", NEMO_RL), ("torchforge", TORCHFORGE), ("verl", VERL)]
         for c in group]


@pytest.fixture(scope="module")
def reward():
    """Correctness is graded with a roomy bound (30 s of CPU), so that a slow machine cannot turn a slow answer into a
    0; the bound itself is tested in test_grader.py."""
    r = grader.Reward(timeout_s=30.0)
    yield r
    r.stop()


def grade(reward, texts: list[str], refs: list[str]) -> list[float]:
    r, errors = score(texts, refs, 1, reward, watch=False)
    assert errors == 0
    return r.tolist()


# the cases we grade wrong, as misses (never as false positives); benchmarks/grading.py lists them with math-verify's
# verdicts
KNOWN_MISSES = {
    ("$0.0833333333333333$", r"\frac{1}{12}"),  # numbers compare exactly: 16 decimals of 1/12 are not 1/12
    ("odd $n$", "odd $n$"),  # words around a variable: the variable alone is read, and skipped as prose
}


def test_cases_no_false_positive_and_no_miss_but_the_known_ones(reward):
    got = grade(reward, [c[0] for c in CASES], [c[1] for c in CASES])
    assert len(CASES) >= 120
    assert [c for c, g in zip(CASES, got) if g == 1 and c[2] == 0] == []  # no false positive
    assert {(c[0], c[1]) for c, g in zip(CASES, got) if g != c[2]} == KNOWN_MISSES


@pytest.mark.parametrize("text, answer", [
    (r"The ratio is $\frac13$", r"\frac13"),  # was 13
    (r"so the slope is $-\frac{10}{9}$", r"-\frac{10}{9}"),  # was 9
    (r"The answer is $\sqrt{16}$", r"\sqrt{16}"),  # was 16
    (r"The golden ratio is $\frac{1+\sqrt{5}}{2}$", r"\frac{1+\sqrt{5}}{2}"),  # was 2
    ("She picks 5 + 50 = 55 apples.\n####: 55", "55"),  # was ': 55'
    (r"Answer: \( x = \frac{1}{2} \) ok", r"x = \frac{1}{2}"),
    (r"The final answer is \[ \frac{3}{4} \]", r"\frac{3}{4}"),
    ("Final Answer: The largest $n$ is 34.", "34"),  # the sentence's last item, a number after its span
    ("The answers are $-2$ and $1$.", r"\{-2, 1\}"),  # items glued by 'and': a list
    (r"Thus $x = \boxed{5}$. Final Answer: The final answer is $5$.", "5"),
    (r"\boxed{255} So he has $10,455. Final Answer: The final answer is $10,455$.", "10,455"),  # said after the box
    (r"\boxed{42}. I am sure the answer is right.", "42"),  # words after a box do not replace it
    ("The answer is (C).", "(C)"),  # no math: the sentence's text
    (r"the total is $12$ apples, more than before.", "12"),  # the last math span, even with words after it
    (r"so x = 1 + \sqrt 5", r"x = 1 + \sqrt 5"),  # math without $ ending the completion: the whole of it
    ("x=2", "x=2"),
    ("It costs $5 and $6 in total, 11", "11"),  # $ before a digit with no closing $: a dollar sign
])
def test_answers_are_read_where_models_write_them(text, answer):
    assert grader.extract_answer(text) == answer


@pytest.mark.parametrize("text, ref, expected", [
    (r"The ratio is $\frac13$", "1/3", 1.0), (r"The ratio is $\frac13$", "13", 0.0),
    (r"so the slope is $-\frac{10}{9}$", "-10/9", 1.0), (r"so the slope is $-\frac{10}{9}$", "9", 0.0),
    (r"The answer is $\sqrt{16}$", "4", 0.0),  # read right, but an expression to compute (issue 38)
    (r"The answer is $\sqrt{16}$", "16", 0.0),
    (r"The golden ratio is $\frac{1+\sqrt{5}}{2}$", "2", 0.0),  # the false positive of the issue
    ("She picks 5 + 50 = 55 apples.\n####: 55", "55", 1.0),
])
def test_the_issue_cases_are_graded_right(reward, text, ref, expected):
    assert grade(reward, [text], [ref]) == [expected]


@pytest.mark.parametrize("text, answer", [
    ("<think>2+3 is 5</think><answer>5</answer>", "5"),
    ("<think>so \\boxed{4}?</think><answer>\\boxed{5}</answer>", "5"),  # the tag's box, not the one before it
    ("<answer>The answer is 7.</answer> Or maybe 8", "7"),  # what follows the tag is not read
    ("<answer>(C)</answer>", "(C)"),  # no number in the tag: its text
    ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last tag
    ("<think>7 * 8 = 56</think><answer>56", "56"),  # unclosed: to the end of the completion
    ("<think>about 3</think><answer></answer>", None),  # an empty tag: no answer
    ("<answer>x7</answer>", "x7"),  # never 7: the tag's text, as no number stands alone in it
    ("The speed is 50 km/h.", "50 km/h"),  # a unit after a number is no prose: the line is read whole
    ("It is 12cm.", "12"),
])
def test_answer_tags_are_read_and_units_are_no_prose(text, answer):
    assert grader.extract_answer(text) == answer


@pytest.mark.parametrize("answer, number", [
    ("12cm", "12"), ("5 kg", "5"), ("50 km/h", "50"), ("9.8 m/s^2", "9.8"), ("100 m^2", "100"), ("100 m", "100"),
    ("3 h", "3"), ("25 \\mu m", "25"), ("-5.5°C", "-5.5"), ("-5.5^\\circ \\mathrm{C}", "-5.5"), ("20 °F", "20"),
    ("€5", "5"), ("5€", "5"), ("£20", "20"), ("\\$30", "30"), ("5 \\, \\mathrm{m/s}", "5"),
    ("7x", "7x"), ("5m", "5m"), ("2\\pi", "2\\pi"), ("x7", "x7"),  # a letter glued to a number may be a variable
])
def test_a_unit_after_a_number_goes(answer, number):
    assert grader.normalize_answer(answer)[0] == number


@pytest.mark.parametrize("text", [
    r"$\frac{1+\sqrt{5}}{2}$", r"\frac{1+\sqrt{5}}{2}", r"so x = 2^{10}", r"it is \sqrt 5", r"$2\pi$", r"2\pi r",
    r"we get 2x + 1", r"$$x^2 + 3x + 2$$ is what we get", r"\[ \binom{5}{2} \] ways", r"x_1 + x_2",
    r"the answer is \frac{3}{4}", r"The answer is $\dfrac{7}{2}$ or so", r"\(\sqrt{2}/2\) it is", r"2 \cdot 3",
    # bare LaTeX with prose after it, so that the line is not read whole
    r"we eat \frac{1}{2} of the cake", r"then 2^{10} bytes are left", r"so 2 \cdot 3 apples each",
    r"it is \sqrt 5 exactly",
    r"the set \{1, 2, 3\} has three elements",
])
def test_no_number_inside_latex_is_ever_the_answer(text):
    """Whatever is read, it is never one of the numbers that stand inside a LaTeX expression of the text."""
    inner = set(re.findall(r"-?\d+(?:\.\d+)?", text))
    answer = grader.extract_answer(text) or ""
    assert not inner & set(answer[2:-2].split(", ") if answer.startswith("\\{") else [answer])  # a list: each


@pytest.mark.parametrize("text, answer", [
    (r"The roots are \boxed{-2} and \boxed{1}.", r"\{-2, 1\}"),
    (r"Final answers: \boxed{3}, \boxed{5}, \boxed{7}", r"\{3, 5, 7\}"),
    (r"$\boxed{1}$ \quad \text{or} \quad $\boxed{4}$", r"\{1, 4\}"),
    (r"So \boxed{4}, \boxed{4}.", "4"),  # repeats count once
    (r"first \boxed{3}, then \boxed{4}", "4"),  # a word between two boxes: the last box alone
    (r"\boxed{1} no no no no no \boxed{2}", "2"),
])
def test_several_boxes_in_a_row_are_a_list(text, answer):
    assert grader.extract_answer(text) == answer


@pytest.mark.parametrize("text, ref, expected", [
    (r"The roots are \boxed{-2} and \boxed{1}.", "1,-2", 1.0),
    (r"The roots are \boxed{-2} and \boxed{1}.", "-2, 1", 1.0),  # a set: order does not matter
    (r"The roots are \boxed{-2} and \boxed{1}.", "1", 0.0),  # a guess beside the answer is no answer
    (r"The roots are \boxed{-2} and \boxed{1}.", "-2", 0.0),
    (r"The roots are \boxed{-2} and \boxed{1}.", "1,-2,3", 0.0),
    (r"\boxed{58}, \boxed{500}", "58500", 0.0),  # two numbers, not one with a thousands comma
    (r"So \boxed{4}, \boxed{4}.", "4", 1.0),
    (" ".join([r"\boxed{9}"] * 50) + r" \boxed{42}", "42", 0.0),  # a flood of guesses: the list {9, 42}
])
def test_a_list_equals_a_reference_holding_the_same_values(reward, text, ref, expected):
    assert grade(reward, [text], [ref]) == [expected]


@pytest.mark.parametrize("text, after", [
    ("x 7}ab", "}ab"),  # a } after a number is text after the answer (it used to be skipped)
    (r"x \boxed{7}}ab", "}ab"),  # only the box's own } belongs to the answer
    (r"x \boxed{12}. ok", ". ok"),
    (r"so $\boxed{5}$. ok", ". ok"),  # a box inside a math span ends with the span
    (r"The answer is $\frac{1}{2}$ indeed", " indeed"),  # a math span ends with its closing $
    (r"The answer is \[ 5 \] indeed", " indeed"),
    (r"\boxed{-2} and \boxed{1}. Done", ". Done"),  # a list ends with its last box
    ("#### 42 done", " done"),
    ("7", ""),
    ("<think>3</think><answer>5</answer> ok", " ok"),  # a tag ends with its </answer>
    (r"<answer>\boxed{5}</answer>. ok", ". ok"),
])
def test_answer_span_ends_where_the_final_answer_ends(text, after):
    """gspo_token's post-answer penalty hits what follows answer_span's end; the span is the answer as extracted."""
    span = grader.answer_span(text)
    assert text[span[1]:] == after
    answer = grader.extract_answer(text)
    for piece in answer[2:-2].split(", ") if answer.startswith("\\{") else [answer]:  # a list: each of its answers
        assert piece in text[span[0]:span[1]]


def test_post_answer_tokens_start_right_after_the_answer():
    """gspo_token's post-answer tokens are those after answer_span's end: a } after a plain answer is penalised, the
    one closing \\boxed{} is not, nor the $ closing the math span that holds the box."""
    import torch

    from grouprl import modeling
    from gspo_token import post_answer_tokens

    tok = modeling.tiny_tokenizer()  # one token a character
    cases = [("x 7}ab", "}ab"), ("x \\boxed{7}}ab", "}ab"), ("so $\\boxed{5}$. ok", ". ok")]
    rows = [tok(text, add_special_tokens=False).input_ids for text, _ in cases]
    T = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (T - len(r)) for r in rows])
    after = post_answer_tokens(tok, ids, mask, [text for text, _ in cases], [tok.eos_token_id])
    assert [tok.decode(row[a]) for row, a in zip(ids, after)] == [expected for _, expected in cases]


@pytest.mark.parametrize("text", [
    "\\(" * 100_000, "\\[" * 100_000, "$1" * 100_000, "1 " * 100_000, "x^1 " * 50_000, "{" * 200_000 + "1",
    "\\boxed{1}, " * 20_000, "$x$ and " * 25_000, "word " * 40_000 + "\\frac{1}{2}",
])
def test_extraction_takes_linear_time_on_hostile_text(text):
    """200,000 characters of unclosed delimiters, numbers or boxes: each delimiter is searched for once, not once per
    opening (quadratic: ~8 s for the first), lists stop at MAX_LIST answers."""
    import time

    t = time.process_time()
    grader.extract_answer(text)
    assert time.process_time() - t < 1.0
